"""DDP (``DistributedDataParallel``) as a parallel engine (``parallel.protocol.Engine``): every rank holds the whole
model, a replica.

Nothing is sharded: a rank's piece of a tensor is the whole tensor, and it counts on rank 0 only (the replicas'
sums would count it ``world`` times). What DDP needs of ampdoctor is the ranks' exchange
(``parallel.exchange.RankExchange``: which rank's batch, forward or backward went non-finite first, before DDP's
all-reduce spread it), which every engine's Monitor joins. A capture under DDP is each rank's whole model (the
manifest's ``sharded`` is null) and replays on one process; there is no layout to record or rebuild.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import CaptureError
from ampdoctor.parallel.pieces import BlockReader, assemble, module_kinds, world_mesh
from ampdoctor.parallel.protocol import Engine


class Ddp:
    """DDP, the engine (``parallel.protocol.Engine``)."""

    name = "ddp"
    label = "DDP (DistributedDataParallel)"
    sharded = False
    monitored = True
    priority = 0
    shares_batch = False
    casts_inputs = False
    replay_requires = ""

    def holds(self, model: nn.Module) -> bool:
        return "DistributedDataParallel" in module_kinds(model)

    def read(self, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> BlockReader:
        return BlockReader([], rank, world)  # whole tensors: a replica counts on rank 0

    def recipe(self, model: nn.Module) -> dict[str, Any] | None:
        return None  # each rank's capture is a whole model

    assemble = staticmethod(assemble)

    def refusal(self, rec: dict[str, Any]) -> str | None:
        return "each rank's capture holds the whole model (DDP): it replays on one process"

    def device_mesh(self, rec: dict[str, Any]) -> Any:
        return world_mesh(rec)

    def rebuild(self, model: nn.Module, rec: dict[str, Any], mesh: Any, low: bool) -> nn.Module:
        raise CaptureError(f"the run's layout cannot be rebuilt: {self.refusal(rec)}")

    def grad_scaler(self) -> type[torch.amp.GradScaler]:
        return torch.amp.GradScaler  # DDP's ranks' gradients agree after its all-reduce


ENGINE: Engine = Ddp()

__all__ = ["ENGINE", "Ddp"]
