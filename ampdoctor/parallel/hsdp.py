"""HSDP: FSDP2's ``fully_shard`` on a 2-D device mesh (replicate, shard). One engine of ``parallel.protocol.Engine``.

Each parameter is a DTensor on the 2-D mesh, ``(Replicate(), Shard(0))``: the ranks of one replica group hold the
whole model between them, sharded as FSDP2 shards it, and every replica group holds the same. FSDP2 reduce-scatters
the gradients within a replica group and all-reduces them across the groups, so after backward every replica holds
the same, global, gradient. Every rank runs its own batch (data parallel over the whole world).

**counts**: a piece counts on the ranks of the first replica group only (coordinate 0 on the replicate dimension),
so each element of the whole gradient counts once and the exchange's norms are the global ones.
**which rank went first**: every rank's batch is its own: the lowest rank that saw it locally (as DDP and FSDP).
**record**: the mesh's shape and dimension names, FSDP2's ``fully_shard`` modules and ``MixedPrecisionPolicy``.
**rebuild**: ``fully_shard`` of the recorded modules on the 2-D mesh; the replay then checks every piece against the
capture's layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import CaptureError
from ampdoctor.parallel.fsdp2 import rebuild as fsdp2_rebuild
from ampdoctor.parallel.fsdp2 import recipe as fsdp2_recipe
from ampdoctor.parallel.fsdp2_tp import MeshReader, device_mesh, fsdp_meshes
from ampdoctor.parallel.pieces import assemble
from ampdoctor.parallel.protocol import Engine

NAME = "hsdp"


class Hsdp:
    """FSDP2 on a (replicate, shard) mesh (module doc)."""

    name = NAME
    label = "HSDP (fully_shard on a 2-D device mesh)"
    sharded = True
    monitored = True
    priority = 25
    shares_batch = False
    casts_inputs = True
    replay_requires = "torch.distributed.fsdp"

    def holds(self, model: nn.Module) -> bool:
        """FSDP2's groups on a 2-D mesh (``HSDPMeshInfo``: a replicate and a shard dimension)."""
        fsdp = fsdp_meshes(model)
        return bool(fsdp) and any(m.ndim == 2 for m in fsdp)

    def read(self, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> MeshReader:
        """Every rank its own batch (no groups); replicas count on the first replica group only."""
        return MeshReader(model, rank, world, None, named=False)

    def recipe(self, model: nn.Module) -> dict[str, Any] | None:
        """``{"engine": "hsdp", "mesh": [replicate, shard], "mesh_dim_names": [...] | None, "fully_shard": [...],
        "mp_policy": {...}}``."""
        fs = fsdp2_recipe(model)
        fsdp = [m for m in fsdp_meshes(model) if m.ndim == 2]
        if fs is None or not fsdp:
            return None
        names = [str(n) for n in fsdp[0].mesh_dim_names] if fsdp[0].mesh_dim_names else None
        return {"engine": NAME, "mesh": [int(x) for x in fsdp[0].shape], "mesh_dim_names": names,
                "fully_shard": fs["fully_shard"], "mp_policy": fs["mp_policy"]}

    def assemble(self, pieces: list[Any], name: str, where: list[str] | None = None, key: str | None = None,
                 ) -> torch.Tensor:
        return assemble(pieces, name, where, key)

    def device_mesh(self, rec: dict[str, Any]) -> Any:
        return device_mesh(rec)

    def refusal(self, rec: dict[str, Any]) -> str | None:
        if len(rec.get("mesh") or []) != 2:
            return f"its mesh has shape {rec.get('mesh')} (a replay rebuilds HSDP on a 2-D (replicate, shard) mesh)"
        if not rec.get("fully_shard"):
            return "it records no fully_shard module"
        return None

    def rebuild(self, model: nn.Module, rec: dict[str, Any], mesh: Any, low: bool) -> nn.Module:
        """``fully_shard`` of the recorded modules on the 2-D ``mesh`` (``low``: with the run's policy)."""
        if [int(x) for x in mesh.shape] != list(rec["mesh"]):
            raise CaptureError(f"the run's mesh was {rec['mesh']}; this replay's is {[int(x) for x in mesh.shape]}")
        return fsdp2_rebuild(model, rec, mesh, low)

    def grad_scaler(self) -> type[torch.amp.GradScaler]:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler


ENGINE: Engine = Hsdp()
"""The engine (``parallel.registry`` finds it)."""

__all__ = ["ENGINE", "NAME", "Hsdp"]
