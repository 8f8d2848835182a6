"""Load the user's spec file: a Python file with build_model, build_dataloader and friends."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ampdoctor.errors import AmpDoctorError, SpecError


@dataclass(frozen=True)
class SpecNames:
    """Names of the functions to look up in the spec file."""

    model: str = "build_model"
    data: str = "build_dataloader"
    loss: str = "loss_fn"
    optimizer: str = "build_optimizer"


@dataclass
class Spec:
    """What a spec file provides."""

    path: Path
    build_model: Callable[[], torch.nn.Module]
    build_dataloader: Callable[[], Iterable[Any]]
    loss_fn: Callable[..., Any] | None
    build_optimizer: Callable[[Any], torch.optim.Optimizer] | None
    names: SpecNames = field(default_factory=SpecNames)
    """The function names it was loaded with."""
    build_scheduler: Callable[..., Any] | None = None
    """Optional ``build_scheduler(optimizer)``: an LR scheduler stepped after every optimizer step."""
    options: dict[str, Any] = field(default_factory=dict)
    """``TRIAGE_OPTIONS = {...}`` of the file: defaults for the command's options (the command line wins)."""
    load_checkpoint: Callable[..., Any] | None = None
    """Optional ``load_checkpoint(model, optimizer, scaler, path)`` for checkpoint layouts ampdoctor does not read."""
    own_model: bool = True
    """False when the spec defines no ``build_model`` (or there is no spec): a replay rebuilds the run's model
    from what the capture or checkpoint recorded (``input.rebuild``)."""


def no_spec(source: str | Path, names: SpecNames | None = None) -> Spec:
    """The spec of a replay without a spec file: the model from the capture or checkpoint ``source``, no
    dataloader, the model's own loss, the optimizer from the run's layout."""
    names = names or SpecNames()
    p = Path(source)

    def model() -> torch.nn.Module:
        raise SpecError(f"{p}: no spec and nothing recorded to rebuild the model from; write a spec with {names.model}()")

    def data() -> Iterable[Any]:
        raise SpecError(f"{p}: the batches are not in the checkpoint; give a spec that defines {names.data}() "
                        f"({names.model}() may be left out: the model comes from the checkpoint)")

    return Spec(p, model, data, None, None, names, own_model=False)


def _where(exc: BaseException, path: Path) -> str:
    """'file:line' of the deepest frame inside the user's file, if any."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if Path(frame.filename).resolve() == path.resolve():
            return f"{path.name}:{frame.lineno}"
    return path.name


where = _where


def load_spec(path: str | Path, names: SpecNames | None = None, *, require_data: bool = True,
              require_model: bool = True) -> Spec:
    """Import the spec file and return its functions; raise SpecError saying what to fix.

    ``require_data=False`` (a replay brings its own batches): build_dataloader may be missing.
    ``require_model=False`` (a replay that rebuilds the run's model): build_model may be missing.
    """
    names = names or SpecNames()
    p = Path(path)
    if not p.exists():
        raise SpecError(f"{p}: no such file; pass the path of a Python file that defines {names.model}() and {names.data}()")
    if p.is_dir() or p.suffix != ".py":
        raise SpecError(f"{p}: expected a .py spec file defining {names.model}() and {names.data}()")
    mod_name = f"_ampdoctor_spec_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise SpecError(f"{p}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        with importable(p):
            spec.loader.exec_module(module)
    except SyntaxError as e:
        raise SpecError(f"{p.name}:{e.lineno}: syntax error ({e.msg}); fix the file and rerun") from None
    except ImportError as e:
        raise SpecError(f"{_where(e, p)}: import failed ({e}); install the package or fix the import") from None
    except Exception as e:
        raise SpecError(f"{_where(e, p)}: the file raised {type(e).__name__} while loading: {e}") from None
    except SystemExit as e:
        raise exited(e, p, "the file", " while loading; keep a script's main code under `if __name__ == \"__main__\":`") from None

    def get(name: str, required: bool) -> Callable[..., Any] | None:
        fn = getattr(module, name, None)
        if fn is None:
            if required:
                found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
                hint = f" (it defines: {', '.join(found)})" if found else ""
                raise SpecError(f"{p.name} has no function {name}(){hint}; define it, or name another with --{_opt(name, names)}")
            return None
        if not callable(fn):
            raise SpecError(f"{p.name}: {name} is a {type(fn).__name__}, not a function")
        return fn

    model = get(names.model, require_model)
    own_model = model is not None
    if model is None:
        def model() -> torch.nn.Module:
            raise SpecError(f"{p.name} has no function {names.model}(); define it (only a replay that rebuilds the run's "
                            "model can do without)")
    data = get(names.data, require_data)
    if data is None:
        def data() -> Iterable[Any]:
            raise SpecError(f"{p.name} has no function {names.data}(); define it (only a replay --from a capture can do without)")
    assert model is not None
    return Spec(p, model, data, get(names.loss, False), get(names.optimizer, False), names,
                build_scheduler=get("build_scheduler", False), load_checkpoint=get("load_checkpoint", False),
                options=_options(module, p), own_model=own_model)


def _opt(name: str, names: SpecNames) -> str:
    return {names.model: "model-fn", names.data: "data-fn", names.loss: "loss-fn"}.get(name, "optimizer-fn")


def call_user(fn: Callable[..., Any], *args: Any, what: str, path: Path) -> Any:
    """Call a spec function, turning its exceptions (and sys.exit) into SpecError with file:line."""
    try:
        return fn(*args)
    except AmpDoctorError:  # ampdoctor's own one line, from a wrapper around the user's function
        raise
    except Exception as e:
        raise SpecError(f"{_where(e, path)}: {what} raised {type(e).__name__}: {e}") from None
    except SystemExit as e:
        raise exited(e, path, what, f"; ampdoctor calls {what} itself, so return the value instead of exiting") from None


def exited(e: SystemExit, path: Path, who: str, then: str) -> SpecError:
    """The one line for the user's code calling sys.exit: where, ``who`` called it with what code, ``then`` what to do."""
    return SpecError(f"{_where(e, path)}: {who} called sys.exit({'' if e.code is None else repr(e.code)}){then}")


@contextlib.contextmanager
def importable(path: str | Path) -> Iterator[None]:
    """Keep the spec file's folder first on sys.path while the block runs, so that the spec's
    functions can import their neighbours lazily (``import helper`` inside build_model()); the
    entry is removed afterwards when this call added it. A path that is not a file changes nothing."""
    p = Path(path)
    if not p.is_file():
        yield
        return
    parent = str(p.resolve().parent)
    added = parent not in sys.path
    if added:
        sys.path.insert(0, parent)
    try:
        yield
    finally:
        if added and parent in sys.path:
            sys.path.remove(parent)


def spec_importable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``fn`` inside ``importable(<its spec_path argument>)``."""
    import functools

    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        path = sig.bind_partial(*args, **kwargs).arguments.get("spec_path")
        if isinstance(path, Spec):
            path = path.path
        if path is None:
            return fn(*args, **kwargs)
        with importable(path):
            return fn(*args, **kwargs)

    return wrapper


def check_optimizer(opt: Any, what: str, path: Path) -> torch.optim.Optimizer:
    """What build_optimizer() returned must be an optimizer (or look like one)."""
    if isinstance(opt, torch.optim.Optimizer):
        return opt
    if opt is None:
        raise SpecError(f"{path.name}: {what} returned None; return the optimizer, e.g. "
                        "`return torch.optim.AdamW(params, lr=1e-3)`")
    if not all(callable(getattr(opt, a, None)) for a in ("step", "zero_grad")) or not hasattr(opt, "param_groups"):
        raise SpecError(f"{path.name}: {what} returned {type(opt).__name__}, not an optimizer; return a "
                        "torch.optim.Optimizer, e.g. `return torch.optim.AdamW(params, lr=1e-3)`")
    return opt  # type: ignore[no-any-return]


def _options(module: Any, p: Path) -> dict[str, Any]:
    """The file's ``TRIAGE_OPTIONS`` (a dict), read from the module the spec was loaded as."""
    opts = getattr(module, "TRIAGE_OPTIONS", None)
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise SpecError(f"{p.name}: TRIAGE_OPTIONS is a {type(opts).__name__}; make it a dict such as "
                        '{"steps": 100, "target": "amp"}')
    return dict(opts)
