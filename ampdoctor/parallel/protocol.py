"""The one protocol every parallel engine implements: how a rank's pieces of the model are read, reduced in the
step's exchange, recorded in a capture, reassembled on one process and rebuilt on N.

An *engine* is one way a model's state is spread over ranks: DDP (whole replicas), FSDP2 (``fully_shard``),
FSDP1 (``FullyShardedDataParallel``), tensor parallelism (DTensor placements from ``parallelize_module``),
DeepSpeed ZeRO, and the 2-D meshes (FSDP2 x tensor parallelism, HSDP). Each is one module of
``ampdoctor.parallel`` holding one object that satisfies ``Engine``; the registry (``parallel.registry``:
``engines()``, ``engine_of(model)``, ``named(name)``) finds it. Adding an engine is adding one module.

The five verbs, in the order a run meets them:

1. **read** (once, no collective): ``holds`` says the engine holds a model; ``read`` gives this rank's
   ``Reader``: ``problem``, why its layout cannot be reduced correctly (the Monitor then turns off with one
   line); ``counts``, whether this rank's piece of a parameter counts in the sums (a replica counts on one rank
   only, so replicated parameters count once); ``piece``, where this rank's piece of a tensor sits in the whole.
2. **reduce** in the exchange: what the ranks add up is generic (``parallel.pieces.Shards``: each parameter's
   sum of squares, the recorded rows' counts by SUM, absmax and smallest non-zero by MAX, in the collective the
   ranks' exchange, ``parallel.exchange.RankExchange``, runs anyway); the engine says which pieces count
   (``counts``), whether the ranks share one batch (``shares_batch``: the first rank is then the one whose
   forward went bad earliest) and whether it casts the batch before the first module reads it
   (``casts_inputs``).
3. **record** in a capture: ``recipe`` is how the engine laid the model out, plain JSON (the manifest's
   ``shards.recipe``, ``{"engine": name, "mesh": [...], ...}``); each tensor's ``piece`` goes to the manifest's
   ``shards.model``. No collective: a capture is written by each rank alone.
4. **reassemble** on one process: ``assemble`` puts the whole tensor back from every rank's piece and its
   layout entry (``parallel.pieces.assemble`` for blocks and flat slices; an engine with other pieces has its
   own).
5. **rebuild** on N processes (``triage --from CAP --nproc N``): ``refusal`` says why a recorded layout cannot
   be rebuilt (one line's fragment), ``device_mesh`` builds the recorded mesh, ``rebuild`` lays the spec's model
   out as recorded on it, and ``grad_scaler`` is the scaler class a replay of its mixed precision uses.

Everything here reads what the engine already built; nothing writes to a parameter, a gradient, the optimizer
or the scaler (``docs/do-no-harm.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

Piece = tuple[torch.Tensor, dict[str, Any]]
"""One rank's piece of a tensor and its layout entry (``Engine.piece``)."""


@runtime_checkable
class Reader(Protocol):
    """One rank's pieces of one model under one engine (``Engine.read``): what the exchange reduces and what a
    capture records. Read off the model once; no collective."""

    problem: str | None
    """Why this layout cannot be reduced correctly (a fragment: "a 2-D device mesh (2, 2) (...)"), or None. The
    Monitor turns off with one line naming it."""
    groups: list[int] | None
    """Which ranks run one batch: per rank of the world the number of its batch group (ranks with the same number
    share a batch, e.g. the tensor-parallel ranks of one data-parallel coordinate of a 2-D mesh), or None: decided
    by ``Engine.shares_batch`` for the whole world (one group, or one group per rank)."""

    def counts(self, p: torch.Tensor) -> bool:
        """Whether this rank's piece of ``p`` counts in the SUM of the exchange: True for a shard, True on exactly
        one rank for a replica (``Replicate`` placement, a plain parameter, FSDP1's ``NO_SHARD``)."""
        ...

    def piece(self, t: torch.Tensor) -> dict[str, Any]:
        """Where this rank's piece of ``t`` (a parameter or buffer) sits in the whole tensor, plain JSON:
        ``{"shape": [...], "offset": [...]}`` (a block; a replica is the whole tensor at offset 0) or
        ``{"shape": [...], "flat": k}`` (elements ``k..`` of the flattened tensor)."""
        ...


@runtime_checkable
class Engine(Protocol):
    """One parallel engine (see the module doc for the five verbs)."""

    name: str
    """The engine's name in the manifest (``sharded``, ``shards.recipe["engine"]``) and in the Monitor:
    ``"ddp"``, ``"fsdp2"``, ``"fsdp1"``, ``"tensor_parallel"``, ``"deepspeed"``..."""
    label: str
    """The engine in a message's words: ``"FSDP2 (fully_shard)"``."""
    sharded: bool
    """True when a rank holds pieces of the model (its capture holds its pieces, reassembled on one process);
    False for whole replicas (DDP: each rank's capture is a whole one)."""
    monitored: bool
    """The Monitor reduces this engine's pieces itself (``parallel.pieces.Shards``); False: a plain Monitor turns off
    on it with one warning (DeepSpeed: its own integration, ``integrations.deepspeed``, reads it)."""
    priority: int
    """The registry asks engines with a higher priority first (a 2-D mesh engine before FSDP2 and tensor
    parallelism, which would otherwise claim its parameters)."""
    shares_batch: bool
    """The ranks run one batch (tensor parallelism): the exchange names the rank whose forward went bad at the
    earliest position, not the lowest rank (``RankExchange.by_position``)."""
    casts_inputs: bool
    """The engine copies the model's inputs before its first module reads them (FSDP's cast to ``param_dtype``:
    ``RankExchange.derived_inputs``)."""
    replay_requires: str
    """The torch module a replay on N ranks needs (``"torch.distributed.fsdp"``...); ``""``: none is possible."""

    # 1. read ---------------------------------------------------------------------------------------------
    def holds(self, model: nn.Module) -> bool:
        """Whether this engine holds ``model``'s parameters (the user's model, wrapped as the user passed it), read
        off its module classes and parameter types: no collective."""
        ...

    def read(self, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> Reader:
        """This rank's pieces of ``model`` (``params``: the optimizer's parameters), read once when the Monitor
        starts: no collective."""
        ...

    # 3. record -------------------------------------------------------------------------------------------
    def recipe(self, model: nn.Module) -> dict[str, Any] | None:
        """How the engine laid ``model`` out, as much as a replay under the same layout needs (plain JSON,
        ``{"engine": self.name, "mesh": [...], ...}``), or None when it records none (the capture then
        reassembles on one process only)."""
        ...

    # 4. reassemble ---------------------------------------------------------------------------------------
    def assemble(self, pieces: list[Piece], name: str, where: list[str] | None = None, key: str | None = None,
                 ) -> torch.Tensor:
        """The whole tensor ``name`` from every rank's piece (ValueError naming the tensor, the rank's manifest in
        ``where`` and the field when the pieces disagree, overlap the shape's end or leave an element out)."""
        ...

    # 5. rebuild ------------------------------------------------------------------------------------------
    def refusal(self, rec: dict[str, Any]) -> str | None:
        """Why a replay cannot rebuild this recorded ``recipe`` (a fragment of one line), or None when it can."""
        ...

    def device_mesh(self, rec: dict[str, Any]) -> Any:
        """The DeviceMesh of the recorded shape (``rec["mesh"]``, with its dimension names) on the CPU, built by every
        rank of a replay (its process groups are collectives: every rank calls it, first)."""
        ...

    def rebuild(self, model: nn.Module, rec: dict[str, Any], mesh: Any, low: bool) -> nn.Module:
        """The spec's fresh ``model`` laid out as ``rec`` records, on ``mesh`` (a DeviceMesh of the recorded
        shape); ``low``: with the run's mixed-precision policy (the run's precision), else none (FP32). Returns
        the model the replay runs (the same object, or its wrapper); CaptureError when the model lacks a
        recorded module or parameter."""
        ...

    def grad_scaler(self) -> type[torch.amp.GradScaler]:
        """The scaler class a replay of the run's mixed precision uses (``ShardedGradScaler`` where the ranks'
        gradients differ, ``torch.amp.GradScaler`` where they agree)."""
        ...


__all__ = ["Engine", "Piece", "Reader"]
