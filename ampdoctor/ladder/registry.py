"""The registered rungs: one factory per name (torchao-style), and the ladder a triage runs.

A rung's factory takes the ``TriageConfig`` (fp16 trains pure FP16 when it is the target, with FP32 master weights
otherwise). The names a user can ask for are ``input.config.STAGES``; each of them has a factory here
(tests/test_ladder.py checks it). A new rung: a module in ``ampdoctor/ladder/`` that calls ``register``, imported by
``ampdoctor/ladder/__init__.py``, and its name in ``input.config.STAGES`` (and ``TARGETS`` if it can be the target).
"""

from __future__ import annotations

from collections.abc import Callable

from ampdoctor.input.config import TriageConfig
from ampdoctor.ladder.rung import Rung

RungFactory = Callable[[TriageConfig], Rung]

_FACTORIES: dict[str, RungFactory] = {}


def register(name: str, factory: RungFactory) -> None:
    """Register the rung ``name``; registering a name twice is a ValueError (two modules claim it)."""
    if name in _FACTORIES and _FACTORIES[name] is not factory:
        raise ValueError(f"the rung {name!r} is registered twice")
    _FACTORIES[name] = factory


def registered() -> tuple[str, ...]:
    """The rung names, in the order they were registered."""
    return tuple(_FACTORIES)


def rung(name: str, config: TriageConfig | None = None) -> Rung:
    """The rung ``name`` under ``config`` (default settings without one); an unknown name is a ValueError."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown stage {name!r}; the stages are {', '.join(_FACTORIES)}")
    return factory(config if config is not None else TriageConfig())


def ladder(config: TriageConfig) -> list[Rung]:
    """The rungs a triage runs, in order (``TriageConfig.stage_list``: FP32 first, every verdict compares with it)."""
    return [rung(name, config) for name in config.stage_list()]
