"""What a capture holds, read off the live run with no collective: host copies of the state (``host_copy``), a
sharded model's local pieces (``local_state``), the RNG states, the last statistics, the model's identity (how to
rebuild it without a spec), the optimizer's layout, the engine's recipe and the model's fingerprint.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ampdoctor.capture.identity import fingerprint
from ampdoctor.capture.schema import MODEL_INPUTS_KEY
from ampdoctor.input import origin
from ampdoctor.input.batches import ModelInputs
from ampdoctor.ladder.compile import is_compiled
from ampdoctor.notify import shown_path
from ampdoctor.parallel.pieces import is_dtensor
from ampdoctor.parallel.registry import engine_of, sharded_engine
from ampdoctor.records import StepStats
from ampdoctor.watch.model_view import local, named_parameters, unwrap, user_name


def host_copy(obj: Any) -> Any:
    """A detached host copy of every tensor in a nested structure; Mappings become dicts (so the copy
    loads with ``weights_only=True``); non-tensor leaves of other types are kept when they are plain
    Python values and dropped (None) otherwise."""
    if isinstance(obj, ModelInputs):
        return {MODEL_INPUTS_KEY: {"args": [host_copy(v) for v in obj.args],
                                   "kwargs": {str(k): host_copy(v) for k, v in obj.kwargs.items()}}}
    if isinstance(obj, torch.Tensor):
        if is_dtensor(obj):
            obj = obj.to_local()  # type: ignore[attr-defined]  # this rank's shard: no collective
        t = obj.detach()
        if t.device.type == "cpu":
            return t.clone()
        return t.to("cpu", non_blocking=True)  # off the critical path; synchronised before writing
    if isinstance(obj, Mapping):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(host_copy(v) for v in obj)
    if isinstance(obj, list):
        return [host_copy(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "to_tuple") or hasattr(obj, "items"):  # ModelOutput / BatchEncoding-like
        try:
            return {k: host_copy(v) for k, v in dict(obj).items()}
        except (TypeError, ValueError):
            return None
    return None


def nbytes(obj: Any) -> int:
    """Bytes of the tensors in a nested structure."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def local_state(model: nn.Module) -> dict[str, Any]:
    """The model's state as this process holds it, with no collective: ``state_dict()`` for a whole model
    (DDP and compiled: the inner module's names); under a sharding engine, whose ``state_dict()`` gathers
    across ranks (a collective only one rank would join), each parameter's and buffer's local shard."""
    inner = unwrap(model)
    if sharded_engine(inner) is None:
        return dict(inner.state_dict())
    out: dict[str, Any] = {}  # (the user's names: no engine wrapper's part, ``watch.model_view.user_name``)
    for n, p in [*inner.named_parameters(), *inner.named_buffers()]:
        out[user_name(n)] = local(p).detach()
    return out


def spec_hint() -> str | None:
    """The running script, when it is itself a spec (defines ``build_model`` and ``build_dataloader``): the
    file to name in the replay command; else None."""
    import sys

    main = sys.modules.get("__main__")
    f = getattr(main, "__file__", None)
    if f and callable(getattr(main, "build_model", None)) and callable(getattr(main, "build_dataloader", None)):
        return shown_path(f)
    return None


def raw_rng() -> tuple[Any, ...]:
    """The RNG states as the libraries hand them out (cheap: no conversion; reading changes none of them)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def rng_states(raw: tuple[Any, ...] | None = None) -> dict[str, Any]:
    """Torch, CUDA, numpy and python RNG states as tensors and plain values (weights_only-safe): now, or
    ``raw`` (``raw_rng()``) taken earlier."""
    t, cuda, np_state, py_state = raw if raw is not None else raw_rng()
    out: dict[str, Any] = {"torch": t}
    if cuda is not None:
        out["cuda"] = cuda
    kind, keys, pos, has_gauss, cached = np_state
    out["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    version, state, gauss = py_state
    out["python"] = {"version": int(version), "state": torch.tensor(state, dtype=torch.int64), "gauss": gauss}
    return out


def stats_json(st: StepStats | None) -> dict[str, Any]:
    """The per-layer statistics of one step, as JSON (rows are ``records.Col`` columns)."""
    if st is None:
        return {}
    return {
        "step": st.step,
        "calls": [{"module": c.module, "inputs": c.inputs, "outputs": c.outputs} for c in st.calls],
        "act": {str(k): _row(v) for k, v in st.act.items()},
        "grad": {str(k): _row(v) for k, v in st.grad.items()},
        "grad_order": st.grad_order,
        "pgrad": {k: _row(v) for k, v in st.pgrad.items()},
        "param": {k: _row(v) for k, v in st.param.items()},
        "model_inputs": st.model_inputs,
        "model_outputs": st.model_outputs,
    }


def _row(r: np.ndarray) -> list[float | str]:
    return [float(x) if math.isfinite(float(x)) else str(float(x)) for x in r]


_IMPL_FLAGS = ("foreach", "fused", "capturable", "differentiable")
"""Optimizer options that choose an implementation, not the arithmetic: left out of the layout."""


def _plain(v: Any, depth: int = 0) -> Any:
    """A JSON value for ``v`` (nested dicts/lists of plain values), or None when it has none."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, torch.dtype):
        return str(v)
    if depth < 6 and isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    if depth < 6 and isinstance(v, Mapping):
        return {str(k): _plain(x, depth + 1) for k, x in v.items()}
    return None


def model_identity(model: nn.Module) -> dict[str, Any]:
    """What the run knows of how to rebuild its model without a spec: the class's import path, and for a
    transformers ``PreTrainedModel`` its config (``to_dict()``, with ``attn_implementation``), for a
    LightningModule its ``hparams``. Plain JSON; reading it imports nothing."""
    inner = unwrap(model)
    cls = type(inner)
    out: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    cfg = getattr(inner, "config", None)
    if cfg is not None and callable(getattr(cfg, "to_dict", None)):
        try:
            out["transformers_config"] = _plain(cfg.to_dict())
            out["attn_implementation"] = getattr(cfg, "_attn_implementation", None)
        except Exception:  # a config that cannot say itself: the class alone
            pass
    hp = getattr(inner, "hparams", None)
    if hp is not None and isinstance(hp, Mapping):
        try:
            out["lightning_hparams"] = _plain(dict(hp))
        except Exception:
            pass
    if len(out) == 1:  # a plain nn.Module: its folder and constructor's arguments (issue 45: replay without a spec)
        try:
            out.update(origin.record(inner))
        except Exception:  # what cannot be read is left out: the replay asks for a spec
            pass
    modules = origin.structure(inner)  # every model: the settings a replay's model must match (a dropout rate)
    if modules:
        out["modules"] = modules
    if is_compiled(model):
        out["compiled"] = True  # the run's model ran under torch.compile: triage --from runs the compile rung
    return out


def optimizer_layout(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> dict[str, Any] | None:
    """The optimizer's class and parameter groups (parameter names, hyperparameters), so a replay can
    rebuild it when the spec has no ``build_optimizer`` (a framework made it: the Trainer's decay and
    no-decay groups). None when a parameter is not the model's."""
    if optimizer is None:
        return None
    names = {id(p): n for n, p in named_parameters(unwrap(model))}
    groups = []
    for g in optimizer.param_groups:
        ps = [names.get(id(p)) for p in g["params"]]
        if any(n is None for n in ps):
            return None
        hyper: dict[str, Any] = {}
        for k, v in g.items():
            if k == "params" or k in _IMPL_FLAGS:
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v):
                hyper[k] = list(v)
            elif v is None or isinstance(v, (bool, int, float, str)):
                hyper[k] = v
        groups.append({"params": ps, "hyper": hyper})
    return {"class": type(optimizer).__name__, "module": type(optimizer).__module__, "groups": groups}


def optimizer_names(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> list[str | None]:
    """The user's name of each optimizer parameter, in the order of its state's indices."""
    if optimizer is None:
        return []
    names = {id(p): n for n, p in named_parameters(unwrap(model))}
    return [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]


def engine_recipe(model: nn.Module) -> dict[str, Any] | None:
    """How the engine sharded the model (its ``parallel.protocol.Engine.recipe``), for a replay under the same
    layout; None when it is not known (the capture is written all the same, and reassembles on one process)."""
    try:
        eng = engine_of(unwrap(model))
        return eng.recipe(model) if eng is not None else None
    except Exception:
        return None


def model_fingerprint(model: nn.Module, layout: dict[str, Any] | None) -> str | None:
    try:
        return fingerprint(model, layout)
    except Exception:
        return None


def process_rank() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover
        pass
    return 0, 1


__all__ = ["engine_recipe", "host_copy", "local_state", "model_fingerprint", "model_identity", "nbytes",
           "optimizer_layout", "optimizer_names", "process_rank", "raw_rng", "rng_states", "spec_hint", "stats_json"]
