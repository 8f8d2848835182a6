"""Which rank went first: one small all-reduce per step, inside the step's one host copy.

Under ``torchrun`` / DDP every rank runs a ``Monitor``. DDP all-reduces the parameter gradients in
backward, so after it a NaN on one rank is a NaN on every rank: every rank's GradScaler skips, and
the parameter gradients no longer say where it came from. What stays local to a rank is its batch,
its forward (module outputs), its loss and the gradients at its activations (backward through the
rank's own graph, before the bucket all-reduce touches parameter gradients). ``RankExchange`` packs
those facts into ``SLOTS`` numbers per rank, on the device, and sums one ``world_size x SLOTS``
float64 tensor across ranks (each rank writes only its own row): one all-reduce of
``40 * world_size`` bytes per step, queued before the step's host copy and brought back with it (a
sharded model adds its sums of squares and parameter rows to it: ``parallel.pieces``).
After it every rank knows, at the same step, which ranks saw a non-finite value, what kind, and in
which module.

Per rank, the row holds:

- ``flags``: bit 0 the loss is non-finite; bit 1 a module output is (a recorded step); bit 2 a
  gradient at an activation is (a recorded step); bit 3 a parameter gradient is; bit 4 the
  model's input (the batch) is; bit 5 (``OFF``) this rank's monitor failed and is leaving.
- ``forward``: the module whose output went non-finite first, in execution order (its inputs were
  finite); with bit 4, the first module that read the batch. ``index + 1`` into ``modules``.
- ``backward``: the module whose outgoing gradient went non-finite first in backward.
- ``param``: the first parameter (in the optimizer's order) with a non-finite gradient, ``index + 1``.
- ``pos``: where in this step's forward the first non-finite output appeared (the order in which the
  forward made its tensors, ``+ 1``; 0 when none, or the step was not recorded). Ranks that run one program
  on one batch (tensor parallelism) make their tensors in the same order, so positions compare across them.

Which rank went first: under DDP and FSDP a rank's batch and forward are its own, and the lowest rank that
saw it locally is named. Under tensor parallelism (``by_position``) the ranks share the batch and a
collective inside the forward (RowwiseParallel's all-reduce) carries one rank's NaN into every rank's next
layer: the rank named is the one whose forward went bad at the earliest position, its own computation (the
others went bad later, through the collective); a tie goes to the lowest rank.

Module codes come from the per-layer statistics, so they are known on recorded steps; on the
others (sentinel mode between full steps) a rank is named by its loss and parameter gradients.
Names index ``named_modules()`` of the unwrapped model, the same list on every rank.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ampdoctor.judge import locate
from ampdoctor.records import LABELS, Col, StepStats

SLOTS = 5
HANDSHAKE_TIMEOUT = 120.0
"""Seconds a rank's monitor waits for every other rank's at start-up before it goes without the exchange."""
LOSS, FORWARD, BACKWARD, GRAD, INPUT = 1, 2, 4, 8, 16
OFF = 32
"""Not a fault: the rank's monitor failed and turned off; every rank turns off after this exchange (the
rank that failed joins it once more, flagged, so no rank waits in a collective the others left)."""
KINDS = ((INPUT, "input"), (FORWARD, "forward"), (LOSS, "loss"), (BACKWARD, "backward"), (GRAD, "grad"))
"""A rank's fault kinds, from the earliest in the step to the latest: its kind is the first that is set."""
LOCAL = LOSS | FORWARD | BACKWARD | INPUT
"""What a rank sees of its own alone (parameter gradients are shared after DDP's all-reduce)."""
LOCAL_KINDS = ("input", "forward", "loss", "backward")


@dataclass(frozen=True)
class RankFault:
    """What one rank saw at one step."""

    rank: int
    flags: int
    module: str | None
    """The first module on this rank (forward, else backward, else the first bad parameter's)."""
    pos: int = 0
    """Where in the forward its first non-finite output appeared (``SLOTS``' ``pos``; 0: unknown)."""

    @property
    def kind(self) -> str:
        """input | forward | loss | backward | grad: the earliest thing that went non-finite on this rank."""
        return next((k for bit, k in KINDS if self.flags & bit), "")

    @property
    def local(self) -> bool:
        """The rank saw it in its own batch, forward, loss or activation gradients (not only in the
        parameter gradients every rank shares after the all-reduce)."""
        return bool(self.flags & LOCAL)

    def token(self) -> str:
        """``rank:kind:module`` as the step log writes it (``1:input:embed``)."""
        return f"{self.rank}:{self.kind}" + (f":{self.module}" if self.module else "")


@dataclass(frozen=True)
class RankView:
    """What every rank learns at a step: the ranks that saw a non-finite value."""

    world: int
    faults: tuple[RankFault, ...]
    off: tuple[int, ...] = ()
    """Ranks whose monitor failed and left (``OFF``): every rank turns off after this step."""
    by_position: bool = False
    """The ranks share one batch (tensor parallelism): the first is the earliest in the forward (module doc)."""
    groups: tuple[int, ...] | None = None
    """Per rank, its batch group: ranks of one group run one batch (FSDP2 x tensor parallelism's ``tp`` ranks), the
    groups run different ones. The first is then the earliest in the forward within the lowest group that saw it
    locally (``by_position`` within a group). None: ``by_position`` says for the whole world."""

    def _pool(self) -> list[RankFault]:
        """The faults the first is chosen from: those seen locally (else all); with ``groups``, only those of the
        lowest rank's group among them."""
        local = [f for f in self.faults if f.local]
        pool = local or list(self.faults)
        if self.groups is not None and pool and len(self.groups) == self.world:
            g = self.groups[pool[0].rank]
            pool = [f for f in pool if self.groups[f.rank] == g]
        return pool

    @property
    def first(self) -> RankFault | None:
        """The rank to blame: the lowest rank that saw it locally, else the lowest that saw it at all (under
        ``by_position``: the rank whose forward went bad earliest; with ``groups``: the earliest in the lowest
        group's forward)."""
        pool = self._pool()
        if (self.by_position or self.groups is not None) and any(f.pos for f in pool):
            return min(pool, key=lambda f: (f.pos if f.pos > 0 else float("inf"), f.rank))
        return pool[0] if pool else None

    @property
    def spread(self) -> bool:
        """``by_position``: other ranks went bad too, all later in the forward than the first (a collective
        carried the first rank's fault to them)."""
        first = self.first
        if not (self.by_position or self.groups is not None) or first is None or first.pos <= 0:
            return False
        others = [f for f in self.faults if f.local and f.rank != first.rank]
        if self.groups is not None and len(self.groups) == self.world:
            if any(self.groups[f.rank] != self.groups[first.rank] for f in others):
                return False  # another batch went bad on its own
        return bool(others) and all(f.pos > first.pos for f in others)

    @property
    def others_clean(self) -> bool:
        """Only the first rank saw it locally: one rank's batch or forward, not every rank's overflow (under
        ``by_position``, also when the others went bad only later in the forward, through a collective)."""
        return sum(f.local for f in self.faults) <= 1 or self.spread

    def column(self, limit: int = 8) -> str:
        """The step log's ``ranks`` column: ``1:input:embed;3:forward:blocks.2`` ('' when all clean)."""
        toks = [f.token() for f in self.faults[:limit]]
        more = len(self.faults) - limit
        return ";".join(toks) + (f";+{more}" if more > 0 else "")


def parse_column(text: str) -> list[tuple[int, str, str | None]]:
    """The ``ranks`` column back into (rank, kind, module) triples (``+N`` overflow markers dropped)."""
    out: list[tuple[int, str, str | None]] = []
    for tok in (text or "").split(";"):
        parts = tok.split(":", 2)
        if len(parts) >= 2 and parts[0].isdigit():
            out.append((int(parts[0]), parts[1], parts[2] if len(parts) == 3 and parts[2] else None))
    return out


def _bad_rows(rows: torch.Tensor) -> torch.Tensor:
    return (rows[:, Col.POSINF] + rows[:, Col.NEGINF] + rows[:, Col.NAN]) > 0


class RankExchange:
    """The per-step all-reduce of every rank's local fault codes (see the module doc)."""

    def __init__(self, group: Any, rank: int, world: int, modules: Sequence[str], params: Sequence[str]) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.modules = list(modules)
        self._index = {m: i for i, m in enumerate(self.modules)}
        self.params = list(params)
        self.calls = 0
        """Exchanges joined so far (a failing step tells whether this step's was joined)."""
        self.derived_inputs = False
        """The engine copies the model's inputs before its first module reads them (FSDP's cast to ``param_dtype``):
        the module that first reads the batch is the first to read such a copy."""
        self.by_position = False
        """The ranks share one batch (tensor parallelism): the first rank is the one whose forward went bad earliest."""
        self.groups: list[int] | None = None
        """Per rank, its batch group (``RankView.groups``), or None."""

    @classmethod
    def detect(cls, modules: Sequence[str], params: Sequence[str], group: Any = None,
               timeout: float = HANDSHAKE_TIMEOUT) -> RankExchange | None:
        """An exchange over ``group`` (default: the world) when torch.distributed runs with more than one
        rank and every rank of it builds a monitor (``handshake``); else None, with a warning."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size(group)
        if world < 2:
            return None
        rank = dist.get_rank(group)
        if not handshake(rank, world, timeout):
            return None
        return cls(group, rank, world, modules, params)

    # on the device ---------------------------------------------------------------------------------
    def _code(self, module: str | None) -> float:
        return float(self._index[module] + 1) if module is not None and module in self._index else 0.0

    def local_row(self, device: torch.device, loss_ok: torch.Tensor, nbad: torch.Tensor, first_bad: torch.Tensor,
                  st: StepStats | None = None, keys: list[Hashable] | None = None, rows: torch.Tensor | None = None,
                  ) -> torch.Tensor:
        """This rank's ``SLOTS`` numbers, on the device, no host sync. ``st``/``keys``/``rows``: a
        recorded step's calls (host) and its statistics rows (device, before the copy)."""
        flags = (~loss_ok.to(device)).to(torch.float64) * LOSS + (nbad.to(device) > 0).to(torch.float64) * GRAD
        fwd = torch.zeros((), device=device, dtype=torch.float64)
        bwd = torch.zeros((), device=device, dtype=torch.float64)
        pos = torch.zeros((), device=device, dtype=torch.float64)
        if st is not None and keys is not None and rows is not None and rows.numel():
            rows = rows.to(device)
            fwd_f, fwd, inp, pos = self._forward(st, keys, rows, device)
            bwd_f, bwd, _ = self._backward(st, keys, rows, device)
            flags = flags + fwd_f * FORWARD + bwd_f * BACKWARD + inp * INPUT
        param = torch.where(nbad.to(device) > 0, first_bad.to(device, torch.float64) + 1, 0.0)
        return torch.stack([flags, fwd, bwd, param, pos]).to(torch.float64)

    def _forward(self, st: StepStats, keys: list[Hashable], rows: torch.Tensor,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(any module output bad, the first one's module code, the batch itself is bad, its position + 1)."""
        producer: dict[int, str] = {}
        for c in st.calls:  # calls end inner-first: the first to claim a tensor is its innermost producer
            for t in c.outputs:
                producer.setdefault(t, c.module)
        inputs = set(st.model_inputs)
        made = min(producer, default=0)  # the engine's copy of the batch is made before any module's output
        idx, order, codes, is_in, reads = [], [], [], [], []
        for i, k in enumerate(keys):
            if isinstance(k, tuple) and k[0] == "act":
                tid = int(k[1])
                idx.append(i)
                order.append(tid)  # tensor ids are handed out in the order the forward made them
                reader = locate.first_consumer_of(st, tid)
                reads.append(self._code(reader) if reader not in (None, LABELS) else 0.0)
                codes.append(self._code(producer.get(tid, locate.MODEL)))
                # the batch, or the engine's copy of it (FSDP's cast: made before any module's output)
                is_in.append(1.0 if tid in inputs or (self.derived_inputs and tid not in producer and tid < made) else 0.0)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        if not idx:
            return zero, zero, zero, zero
        bad = _bad_rows(rows[torch.tensor(idx, device=device)])
        anyb, code, pos = self._first(bad, order, codes, device)
        inp = (bad & (torch.tensor(is_in, device=device) > 0)).any()
        # a bad batch: the first module that reads a non-finite tensor; none (a label only the loss reads): LABELS
        read = torch.tensor(reads, dtype=torch.float64, device=device)
        down_any, down, _ = self._first(bad & (read > 0), order, reads, device)
        code = torch.where(inp, torch.where(down_any > 0, down, float(len(self.modules) + 1)), code)
        return anyb, code, inp.to(torch.float64), pos

    def _backward(self, st: StepStats, keys: list[Hashable], rows: torch.Tensor,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(any activation gradient bad, the module whose outgoing gradient went bad first, its arrival + 1)."""
        arrival: dict[int, int] = {}
        for pos, tid in enumerate(st.grad_order):
            arrival.setdefault(tid, pos)
        outputs = set(st.model_outputs)
        consumers: dict[int, list[str]] = {}
        for c in st.calls:
            for t in c.inputs:
                consumers.setdefault(t, []).append(c.module)
        idx, order, codes = [], [], []
        for i, k in enumerate(keys):
            if isinstance(k, tuple) and k[0] == "grad":
                tid = int(k[1])
                idx.append(i)
                order.append(arrival.get(tid, len(st.grad_order)))
                if tid in outputs:  # bad where it enters the model: the module that produced the output
                    mod = locate.producer(st, tid)
                    mod = (locate.entry_child(st) or mod) if mod == locate.MODEL else mod
                else:  # the gradient at t came out of the backward of t's (last, innermost) reader
                    inner = locate.innermost(consumers.get(tid, []))
                    mod = inner[-1] if inner else None
                codes.append(self._code(mod))
        zero = torch.zeros((), dtype=torch.float64, device=device)
        if not idx:
            return zero, zero, zero
        return self._first(_bad_rows(rows[torch.tensor(idx, device=device)]), order, codes, device)

    @staticmethod
    def _first(bad: torch.Tensor, order: list[int], codes: list[float],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(any bad, the first bad one's code, its place in ``order`` + 1): 0 for the last two when none is bad."""
        o = torch.tensor(order, dtype=torch.float64, device=device)
        key = torch.where(bad, o, torch.full_like(o, float("inf")))
        at = key.argmin()
        first = torch.tensor(codes, dtype=torch.float64, device=device)[at]
        anyb = bad.any()
        return anyb.to(torch.float64), torch.where(anyb, first, 0.0), torch.where(anyb, o[at] + 1, 0.0)

    def exchange(self, row: torch.Tensor, sums: torch.Tensor | None = None,
                 maxes: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's row, summed into one ``world x SLOTS`` tensor: the step's one collective.

        ``sums``: more numbers summed across ranks in the same collective (a sharded model's sums of
        squares and counts, ``parallel.pieces``); ``maxes``: numbers reduced by MAX, in a second collective.
        Returns ``world x SLOTS`` numbers, then the summed ``sums``, then the ``maxes``, as one vector."""
        import torch.distributed as dist

        self.calls += 1
        n = self.world * SLOTS
        full = torch.zeros(n + (sums.numel() if sums is not None else 0), dtype=torch.float64, device=row.device)
        full[self.rank * SLOTS: (self.rank + 1) * SLOTS] = row
        if sums is not None:
            full[n:] = sums.reshape(-1).to(row.device, torch.float64)
        dist.all_reduce(full, group=self.group)
        if maxes is None:
            return full
        mx = maxes.reshape(-1).to(row.device, torch.float64).clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=self.group)
        return torch.cat([full, mx])

    # on the host -----------------------------------------------------------------------------------
    def decode(self, host: np.ndarray) -> RankView:
        """The host copy of ``exchange``'s result into the ranks that saw something."""
        faults = []
        off = []
        table = np.asarray(host, dtype=np.float64)[: self.world * SLOTS].reshape(self.world, SLOTS)
        for r, (flags, fwd, bwd, param, pos) in enumerate(table):
            fl = int(flags)
            if fl & OFF:
                off.append(r)
                fl &= ~OFF
            if not fl:
                continue
            module = self._module(int(fwd)) or self._module(int(bwd))
            if module is None and int(param) > 0 and int(param) - 1 < len(self.params):
                module = locate.module_of_param(self.params[int(param) - 1], self.modules)
            faults.append(RankFault(r, fl, module, int(pos)))
        return RankView(self.world, tuple(faults), tuple(off), self.by_position,
                        tuple(self.groups) if self.groups is not None else None)

    def _module(self, code: int) -> str | None:
        if code == len(self.modules) + 1:  # a batch tensor no module read: its labels, read by the loss
            return LABELS
        return self.modules[code - 1] if 0 < code <= len(self.modules) else None


_made = [0]


def handshake(rank: int, world: int, timeout: float = HANDSHAKE_TIMEOUT) -> bool:
    """Whether every rank builds a monitor, agreed through torch.distributed's key-value store, so that
    a monitor on rank 0 alone (a common pattern for logging) never waits forever in the exchange.

    Each rank's n-th monitor writes its key and waits up to ``timeout`` for every rank's, then proposes
    a decision: ``on`` if it saw every key, ``off`` if it timed out. The first proposal is stored
    atomically (``compare_set``) and every rank adopts the stored one, so the ranks always agree, also
    when one times out at the moment another arrives (two answers there would leave one rank in an
    exchange the other never joins). No store (another backend's launcher): assumed yes.
    ``AMPDOCTOR_RANK_TIMEOUT`` (seconds) overrides ``timeout``."""
    import os

    timeout = float(os.environ.get("AMPDOCTOR_RANK_TIMEOUT", timeout))
    n = _made[0]
    _made[0] += 1
    try:
        import torch.distributed.distributed_c10d as c10d

        store = c10d._get_default_store()
    except Exception:  # pragma: no cover - no default store
        return True
    agreed = agree(store, f"ampdoctor/monitor{n}", rank, world, timeout)
    if not agreed:
        _warn_alone(rank, world, timeout)
    return agreed


def agree(store: Any, base: str, rank: int, world: int, timeout: float) -> bool:
    """The protocol of :func:`handshake` under the keys ``base/…``: one answer for every rank."""
    from datetime import timedelta

    try:
        store.set(f"{base}/rank{rank}", "1")
        store.wait([f"{base}/rank{r}" for r in range(world)], timedelta(seconds=timeout))
        proposal = "on"
    except Exception:
        proposal = "off"
    try:
        decided = store.compare_set(f"{base}/decision", "", proposal)
    except Exception:  # pragma: no cover - a store without compare_set: no exchange rather than a hang
        return False
    return (decided.decode() if isinstance(decided, bytes) else str(decided)) == "on"


def _warn_alone(rank: int, world: int, timeout: float) -> None:
    import warnings

    from ampdoctor.report.alerts import rank_alone

    warnings.warn(rank_alone(rank, world, timeout), RuntimeWarning, stacklevel=4)


def rank_path(path: str, rank: int) -> str:
    """``steps.csv`` → ``steps.rank1.csv``, ``cap`` → ``cap.rank1``: one file per rank."""
    p = Path(path)
    if p.suffix and p.suffix != ".":
        return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))
    return str(p.with_name(f"{p.name}.rank{rank}"))


__all__ = ["HANDSHAKE_TIMEOUT", "KINDS", "OFF", "LOCAL_KINDS", "handshake", "SLOTS", "RankExchange", "RankFault", "RankView", "parse_column", "rank_path"]
