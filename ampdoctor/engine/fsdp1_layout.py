"""An FSDP1 layout (``FullyShardedDataParallel(use_orig_params=True)``): recorded at capture time (plain JSON, the
manifest's ``shards.recipe``) and rebuilt on the spec's model for a replay on N ranks (``engine.shard_replay``).

Recorded, read off the wrapped model with no collective: ``wrapped``, the modules each wrapped in their own
``FullyShardedDataParallel`` (the user's names, ``""`` the model, children first); ``mixed_precision``, the
``MixedPrecision``'s ``param_dtype``, ``reduce_dtype`` and ``buffer_dtype`` as names (null: none);
``sharding_strategy`` (its name) and ``use_orig_params``. A replay rebuilds ``FULL_SHARD`` (the strategy
tested) with ``use_orig_params=True`` and the model wrapped at its root; anything else is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ampdoctor.engine.shards import _dtype_name
from ampdoctor.errors import CaptureError
from ampdoctor.watch.model_view import unwrap, user_name

STRATEGIES = ("FULL_SHARD",)
"""The sharding strategies a replay rebuilds."""


def recipe(model: nn.Module) -> dict[str, Any] | None:
    """The FSDP1 layout of ``model`` (see the module), or None when no module is a ``FullyShardedDataParallel``."""
    inner = unwrap(model)
    wrapped: list[str] = []
    first: Any = None
    for name, m in inner.named_modules():
        if type(m).__name__ == "FullyShardedDataParallel":
            wrapped.append(user_name(name))
            first = first if first is not None else m
    if first is None:
        return None
    mp = getattr(first, "mixed_precision", None)
    strat = getattr(first, "sharding_strategy", None)
    pg = getattr(first, "process_group", None)
    return {"engine": "fsdp1", "wrapped": wrapped[::-1], "mesh": [int(pg.size())] if pg is not None else None,
            "mixed_precision": None if mp is None else {k: _dtype_name(getattr(mp, k, None))
                                                        for k in ("param_dtype", "reduce_dtype", "buffer_dtype")},
            "sharding_strategy": str(getattr(strat, "name", strat)),
            "use_orig_params": bool(getattr(first, "_use_orig_params", False))}


def refusal(rec: dict[str, Any]) -> str | None:
    """Why a replay cannot rebuild this recorded layout (a fragment of one line), or None when it can."""
    if not rec.get("use_orig_params"):
        return "it was wrapped with use_orig_params=False (a replay rebuilds use_orig_params=True only)"
    if rec.get("sharding_strategy") not in STRATEGIES:
        return f"its sharding strategy is {rec.get('sharding_strategy')} (a replay rebuilds {' and '.join(STRATEGIES)})"
    if "" not in (rec.get("wrapped") or []):
        return "its model was not wrapped at the root (a replay wraps the model and its recorded modules)"
    return None


def rebuild(model: nn.Module, rec: dict[str, Any], low: bool) -> nn.Module:
    """The spec's ``model`` wrapped as recorded (``low``: with its ``MixedPrecision``, else none), on the default
    process group; CaptureError when the model lacks a recorded module."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    mods = dict(model.named_modules())
    inner = [n for n in rec["wrapped"] if n]
    for n in inner:
        if n not in mods:
            raise CaptureError(f"the run wrapped {n!r} in FullyShardedDataParallel, which the spec's model has no module of")
    ids = {id(mods[n]) for n in inner}
    mp = {k: getattr(torch, v) for k, v in (rec.get("mixed_precision") or {}).items() if v}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in ids)
    return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"), auto_wrap_policy=policy,
                                    sharding_strategy=ShardingStrategy[rec["sharding_strategy"]],
                                    mixed_precision=MixedPrecision(**mp) if low and mp else None)


__all__ = ["STRATEGIES", "rebuild", "recipe", "refusal"]
