"""Sentinel mode and the warm-up: which steps get full per-layer statistics, and a trip's own statistics.

``mode="sentinel"``: every step only the sentinel (each parameter gradient's norm, in the step's one host copy),
full statistics every ``full_every`` steps and from a step that trips it through the ``full_after`` steps after.
In full mode on the CPU while the statistics kernel builds (``watch.fused``), the same schedule stands in until
the kernel is ready (``AMPDOCTOR_WARMUP=full`` keeps full statistics on the eager path instead).
"""

from __future__ import annotations

import os

import torch

from ampdoctor.engine.monitor.config import MonitorConfig
from ampdoctor.engine.step import Measured, TrainStep
from ampdoctor.parallel.exchange import RankExchange
from ampdoctor.parallel.pieces import trip_stats
from ampdoctor.records import StepStats, nonfinite
from ampdoctor.watch import fused
from ampdoctor.watch.hooks import Hooks


class Sentinel:
    """The recorded-step schedule of sentinel mode and of the warm-up, over the monitor's hooks and recipe."""

    def __init__(self, cfg: MonitorConfig, hooks: Hooks, recipe: TrainStep) -> None:
        self.mode = cfg.mode
        self.full_every = cfg.full_every
        self.full_after = cfg.full_after
        self.hooks = hooks
        self.recipe = recipe
        self.full_until = -1
        """Steps before this one are recorded in full (set when the sentinel trips)."""
        self.warming = False
        """Full mode while the statistics kernel builds: sentinel checks only, until it is ready."""
        if self.mode == "sentinel":
            hooks.record_if = self.wants_full

    def wants_full(self, step: int) -> bool:
        """Sentinel mode: whether ``step`` gets full per-layer statistics."""
        return step % self.full_every == 0 or step < self.full_until

    def scheduled(self, step: int) -> bool:
        """Whether ``step`` is recorded in full (every rank's schedule is the same)."""
        h = self.hooks
        return h.record_if(step) if h.record_if is not None else step % h.every == 0

    def warm_start(self, device: torch.device, exchanged_shards: bool) -> None:
        """Full mode on the CPU while the statistics kernel is being built: sentinel checks only (every step's loss
        and gradient norms), full statistics from a step that trips them, and on every step once the kernel is
        ready. The eager path would cost every step 1.7x meanwhile."""
        if self.mode != "full" or device.type != "cpu" or os.environ.get("AMPDOCTOR_WARMUP", "sentinel") == "full":
            return
        if exchanged_shards:
            return  # the ranks' kernels get ready at different steps: their recorded steps (collectives) must agree
        if not fused.pending():
            return
        self.hooks.record_if = self._warm_wants_full
        self.recipe.sentinel = self.hooks.fmt.max
        self.warming = True

    def _warm_wants_full(self, step: int) -> bool:
        if self.warming and fused.pending():
            return step < self.full_until
        self.warming = False  # the kernel is ready (or will not come): full statistics from now on
        self.hooks.record_if = None
        self.recipe.sentinel = None
        return step % self.hooks.every == 0

    def trip(self, m: Measured, step: int, ranks: RankExchange | None) -> None:
        """A step that tripped the sentinel: the next ``full_after`` steps are recorded in full, and a tripping step
        that passed unrecorded gets what is still there, in full (its parameter gradients' rows)."""
        if not (self.mode == "sentinel" or self.warming):
            return
        trip = m.skip or (m.stats is None and m.tripped)
        if self.recipe.shards is not None and m.ranks is not None:  # the same on every rank: their collectives agree
            trip = bool(m.ranks.faults) or m.tripped
        if not trip:
            return
        self.full_until = max(self.full_until, step + 1 + self.full_after)
        if m.stats is not None:
            return
        st = self.trip_stats(step, 1.0 / m.scale if self.recipe.grads_scaled and m.scale else None, ranks)
        m.stats = st
        if st.pgrad:
            m.bad_params = [n for n, row in st.pgrad.items() if nonfinite(row) > 0]
            m.bad_count = len(m.bad_params)
            if m.skip and m.reason.startswith("nonfinite_grad"):
                m.reason = self.recipe.grad_reason(st, m.bad_params)

    def trip_stats(self, step: int, inv_scale: float | None, ranks: RankExchange | None) -> StepStats:
        """The sentinel tripped on a step not recorded: take what is still there in full now, the parameter
        gradients (and weights with ``weights=True``). A second host copy, on this step only. ``inv_scale``: the
        gradients still carry the loss scale (see ``Hooks.after_backward``)."""
        return trip_stats(self.hooks, step, inv_scale, self.recipe.shards, ranks)


__all__ = ["Sentinel"]
