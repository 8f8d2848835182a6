"""The parallel engines, found by module: every module of ``ampdoctor.parallel`` that defines ``ENGINE`` (an object
satisfying ``parallel.protocol.Engine``) is one. Adding an engine is adding one module; nothing here names one.

``engines()`` lists them (highest ``priority`` first, then by name), ``engine_of(model)`` is the first that holds a
model, ``named(name)`` the one a manifest names.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from torch import nn

from ampdoctor.parallel.protocol import Engine


@functools.cache
def engines() -> tuple[Engine, ...]:
    """Every engine module's ``ENGINE``, highest priority first (ties by name)."""
    import ampdoctor.parallel as pkg

    found: list[Engine] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        eng = getattr(mod, "ENGINE", None)
        if eng is not None:
            found.append(eng)
    return tuple(sorted(found, key=lambda e: (-e.priority, e.name)))


def engine_of(model: nn.Module) -> Engine | None:
    """The engine holding ``model`` (the first, by priority, whose ``holds`` says so), or None (one process's model)."""
    return next((e for e in engines() if e.holds(model)), None)


def sharded_engine(model: nn.Module) -> str | None:
    """The name of the engine holding ``model``'s parameters in pieces (``"fsdp1"``, ``"fsdp2"``,
    ``"tensor_parallel"``, ``"deepspeed"``...), or None (one process's whole model, DDP included)."""
    eng = engine_of(model)
    return eng.name if eng is not None and eng.sharded else None


def named(name: str) -> Engine | None:
    """The engine a manifest names (``shards.recipe["engine"]``), or None for a name no module defines."""
    return next((e for e in engines() if e.name == name), None)


__all__ = ["engine_of", "engines", "named", "sharded_engine"]
