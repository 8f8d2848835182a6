"""FSDP1 (``FullyShardedDataParallel(use_orig_params=True)``) as a parallel engine (``parallel.protocol.Engine``):
a rank's pieces are its slices of the flattened parameters (``flat`` layout entries); its layout is recorded at
capture time (plain JSON, the manifest's ``shards.recipe``) and rebuilt on the spec's model for a replay on N
ranks (``engine.shard_replay``).

Recorded, read off the wrapped model with no collective: ``wrapped``, the modules each wrapped in their own
``FullyShardedDataParallel`` (the user's names, ``""`` the model, children first); ``mixed_precision``, the
``MixedPrecision``'s ``param_dtype``, ``reduce_dtype`` and ``buffer_dtype`` as names (null: none);
``sharding_strategy`` (its name) and ``use_orig_params``. A replay rebuilds ``FULL_SHARD`` (the strategy
tested) with ``use_orig_params=True`` and the model wrapped at its root; anything else is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import CaptureError
from ampdoctor.parallel.pieces import BlockReader, assemble, dtype_name, module_kinds, world_mesh
from ampdoctor.parallel.protocol import Engine
from ampdoctor.watch.model_view import unwrap, user_name

STRATEGIES = ("FULL_SHARD",)
"""The sharding strategies a replay rebuilds."""


def _fsdp1_flat(inner: nn.Module) -> dict[int, tuple[list[int], int]]:
    """FSDP1 (``use_orig_params=True``): id of each original parameter → (its shape, where this rank's slice
    starts in it, flattened), read from the flat parameters' ``_fqns``/``_shapes``/``_shard_param_infos``."""
    out: dict[int, tuple[list[int], int]] = {}
    for m in inner.modules():
        fp = getattr(m, "_flat_param", None)
        infos = getattr(fp, "_shard_param_infos", None)
        params = getattr(fp, "_params", None)
        shapes = getattr(fp, "_shapes", None)
        if infos is None or params is None or shapes is None:
            continue
        for p, shape, info in zip(params, shapes, infos, strict=False):
            start = int(info.intra_param_start_idx or 0) if info.in_shard else 0
            out[id(p)] = ([int(x) for x in shape], start)
    return out


def _fsdp1_strategy(inner: nn.Module) -> tuple[str, int | None]:
    for m in inner.modules():
        if type(m).__name__ == "FullyShardedDataParallel":
            strat = getattr(m, "sharding_strategy", None)
            pg = getattr(m, "process_group", None)
            size = pg.size() if pg is not None and hasattr(pg, "size") else None
            return str(getattr(strat, "name", strat)), size
    return "", None


class Reader(BlockReader):
    """This rank's slices of the flat parameters (``{"shape", "flat"}``), whole tensors elsewhere; a replica
    (``NO_SHARD``) counts on rank 0 only. A hybrid strategy, a process group that is not the world, or flat
    parameters (``use_orig_params=False``) are a ``problem``."""

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> None:
        strat, size = _fsdp1_strategy(model)
        super().__init__([], rank, world, plain_shards=strat != "NO_SHARD")
        self.flat = _fsdp1_flat(model)
        if strat.startswith("HYBRID") or (size is not None and size != world):
            self.problem = f"a {strat or 'process'} group of {size} rank(s) in a world of {world}"
        if any(getattr(p, "_is_flat_param", False) or type(p).__name__ == "FlatParameter" for p in params):  # (their pieces are no parameter's alone)
            self.problem = "flat parameters (use_orig_params=False; pass use_orig_params=True)"
        for t in [*params, *model.parameters()]:
            self.problem = self.problem or self.mesh_problem(t)

    def piece(self, t: torch.Tensor) -> dict[str, Any]:
        hit = self.flat.get(id(t))
        if hit is not None:
            return {"shape": hit[0], "flat": hit[1]}
        return super().piece(t)


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
            "mixed_precision": None if mp is None else {k: dtype_name(getattr(mp, k, None))
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


def rebuild(model: nn.Module, rec: dict[str, Any], mesh: Any, low: bool) -> nn.Module:
    """The spec's ``model`` wrapped as recorded (``low``: with its ``MixedPrecision``, else none), on the default
    process group (``mesh``: unused, FSDP1 takes the world); CaptureError when the model lacks a recorded module."""
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


class Fsdp1:
    """FSDP1 (``FullyShardedDataParallel`` modules), the engine (``parallel.protocol.Engine``)."""

    name = "fsdp1"
    label = "FSDP1 (FullyShardedDataParallel)"
    sharded = True
    monitored = True
    priority = 30
    shares_batch = False
    casts_inputs = True
    replay_requires = "torch.distributed.fsdp"

    def holds(self, model: nn.Module) -> bool:
        return "FullyShardedDataParallel" in module_kinds(model)

    def read(self, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> Reader:
        return Reader(model, params, rank, world)

    recipe = staticmethod(recipe)
    assemble = staticmethod(assemble)
    refusal = staticmethod(refusal)
    rebuild = staticmethod(rebuild)

    def device_mesh(self, rec: dict[str, Any]) -> Any:
        return world_mesh(rec)

    def grad_scaler(self) -> type[torch.amp.GradScaler]:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler


ENGINE: Engine = Fsdp1()

__all__ = ["ENGINE", "STRATEGIES", "Fsdp1", "Reader", "rebuild", "recipe", "refusal"]
