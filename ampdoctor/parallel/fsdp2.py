"""FSDP2 (``fully_shard``: DTensor parameters on ``FSDPModule``s) as a parallel engine (``parallel.protocol.Engine``).

A rank's pieces are its DTensors' local shards (``parallel.pieces.BlockReader``, on a 1-D mesh over the world);
its layout is recorded at capture time (plain JSON, the manifest's ``shards.recipe``: the modules ``fully_shard``
was applied to, their ``MixedPrecisionPolicy`` and the mesh's shape) and rebuilt on the spec's model for a replay
on N ranks (``engine.shard_replay``) by applying ``fully_shard`` to the same modules, children first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import CaptureError
from ampdoctor.parallel.pieces import BlockReader, assemble, dtensor_holds, dtype_name, is_dtensor, module_kinds, world_mesh
from ampdoctor.parallel.protocol import Engine
from ampdoctor.watch.model_view import named_parameters, unwrap, user_name


def recipe(model: nn.Module) -> dict[str, Any] | None:
    """How FSDP2 sharded the model, as much as a replay under the same layout needs (plain JSON, the manifest's
    ``shards.recipe``): the modules ``fully_shard`` was applied to (the user's names, ``""`` the model, children
    first), their ``MixedPrecisionPolicy`` and the mesh's shape. None for any other layout (FSDP1's wrapping and
    a tensor-parallel plan: ``parallel.fsdp1``, ``parallel.tp``)."""
    inner = unwrap(model)
    mods: list[str] = []
    mp: dict[str, Any] | None = None
    mesh: list[int] | None = None
    for name, m in inner.named_modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None:
            continue
        mods.append(user_name(name))
        group = getattr(get(), "_fsdp_param_group", None)
        pol = getattr(group, "mp_policy", None)
        if pol is not None and mp is None:
            mp = {k: dtype_name(getattr(pol, k, None)) for k in ("param_dtype", "reduce_dtype", "output_dtype")}
            mp["cast_forward_inputs"] = bool(getattr(pol, "cast_forward_inputs", True))
    for p in inner.parameters():
        if is_dtensor(p):
            mesh = [int(x) for x in p.device_mesh.shape]  # type: ignore[attr-defined]
            break
    if not mods or mesh is None:
        return None
    return {"engine": "fsdp2", "fully_shard": mods[::-1], "mp_policy": mp, "mesh": mesh}


def rebuild(model: nn.Module, rec: dict[str, Any], mesh: Any, low: bool) -> nn.Module:
    """``fully_shard`` applied to the spec's ``model``'s recorded modules on ``mesh``, in the recorded order
    (``low``: with the run's ``MixedPrecisionPolicy``, else the default one); CaptureError when the model lacks
    a recorded module."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = {k: getattr(torch, v) if isinstance(v, str) else v for k, v in (rec.get("mp_policy") or {}).items()}
    policy = MixedPrecisionPolicy(**mp) if low and mp else MixedPrecisionPolicy()
    mods = dict(model.named_modules())
    for name in rec["fully_shard"]:
        if name not in mods:
            raise CaptureError(f"the run applied fully_shard to {name!r}, which the spec's model has no module of")
        fully_shard(mods[name], mesh=mesh, mp_policy=policy)
    return model


class Fsdp2:
    """FSDP2, the engine (``parallel.protocol.Engine``)."""

    name = "fsdp2"
    label = "FSDP2 (fully_shard)"
    sharded = True
    monitored = True
    priority = 20
    shares_batch = False
    casts_inputs = True
    replay_requires = "torch.distributed.fsdp"

    def holds(self, model: nn.Module) -> bool:
        return dtensor_holds(model) and any(k.startswith("FSDP") for k in module_kinds(model))

    def read(self, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> BlockReader:
        return BlockReader([*params, *(p for _, p in named_parameters(model))], rank, world)

    recipe = staticmethod(recipe)
    assemble = staticmethod(assemble)
    rebuild = staticmethod(rebuild)

    def refusal(self, rec: dict[str, Any]) -> str | None:
        return None

    def device_mesh(self, rec: dict[str, Any]) -> Any:
        return world_mesh(rec)

    def grad_scaler(self) -> type[torch.amp.GradScaler]:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler


ENGINE: Engine = Fsdp2()

__all__ = ["ENGINE", "Fsdp2", "rebuild", "recipe"]
