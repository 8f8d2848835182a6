"""``Monitor``: watch a mixed-precision training loop step by step, in your own loop.

Two ways to use it::

    mon = Monitor(model, opt, scaler, log="steps.csv", max_norm=1.0)
    for x, y in data:
        with mon.autocast():
            loss = loss_fn(model(x), y)
        rec = mon.step(loss)            # backward, unscale_, clip, step (or skip), update, zero_grad
    mon.close()

or keep your own step and call two hooks::

    scaler.scale(loss).backward()
    mon.after_backward(loss)            # unscale_ (if you have not), norms, clip, statistics
    scaler.step(opt); scaler.update()
    mon.after_step()                    # writes the log row, skip rate, alerts
    opt.zero_grad(set_to_none=True)

The step ``Monitor.step`` runs, in the order the seed articles insist on:
loss finiteness check (on the device) → ``scaler.scale(loss).backward()`` → fault injection (if
asked) → ``scaler.unscale_(opt)`` → global L2 norm and clip (pre- and post-clip norms) →
**one copy to the host** → ``scaler.step(opt)`` (or ``opt.step()``), skipped when the loss or a
gradient is non-finite → ``scaler.update()``, on the skip path too → ``zero_grad(set_to_none=True)``.

Host synchronisations in a step:

- the monitor's own statistics (loss, norms, the scaler's found-inf flag, scale, growth tracker,
  the first non-finite parameter, and ``Hooks``' per-layer rows) come back in **one** copy, in
  ``after_backward``; ``after_step`` makes none. Nothing in a hook synchronises.
- ``GradScaler.step`` makes its own (``found_inf.item()``), only when the step is applied: on a
  skipped step the monitor already knows, and calls ``scaler.update()`` without ``scaler.step``.
- your optimizer may make its own (e.g. Adam's step counter on the CPU).

A non-finite loss is detected before backward but acted on at that one copy: backward still runs
(deciding earlier would cost a second sync), and the step is skipped all the same, with reason
``nonfinite_loss``; with a GradScaler the monitor adds it to the scaler's found-inf flag so the
scaler backs off as it does for an overflow.

The monitor reads GradScaler's device-side state (``_scale``, ``_growth_tracker``,
``_found_inf_per_device``) to avoid the syncs of ``get_scale()``; these fields have been stable
since PyTorch 1.6.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ampdoctor.engine.capture import DEFAULT_MAX_BYTES, Capture
from ampdoctor.engine.ranks import RankExchange, RankView, rank_path
from ampdoctor.engine.step import Measured, Precision, TrainStep
from ampdoctor.errors import AmpDoctorError, UsageError
from ampdoctor.formats import BF16, FP16
from ampdoctor.judge.scaler import ScaleDiagnosis, SkipLedger, diagnose_scale, skip_ledger
from ampdoctor.records import StepStats, nonfinite
from ampdoctor.watch.fused import start_build
from ampdoctor.watch.hooks import Hooks, unwrap
from ampdoctor.watch.steplog import Mode, StepLogWriter

log = logging.getLogger("ampdoctor")
log.addHandler(logging.NullHandler())  # a library: no output unless the application configures logging

EXTRA_COLUMNS: tuple[str, ...] = ("scale_after", "skip_rate", "nonfinite_params", "injected")
"""Columns the monitor writes after the standard ones (see ``steplog.COLUMNS``)."""
RANK_COLUMNS: tuple[str, ...] = ("rank", "ranks")
"""Under torch.distributed, after ``EXTRA_COLUMNS``: this rank, and every rank that saw a non-finite
value at the step as ``rank:kind:module`` (``engine.ranks.RankView.column``), the same on every rank."""
STATE_VERSION = 1


class SkipRateError(AmpDoctorError):
    """The rolling skip rate stayed above ``max_skip_rate`` for ``patience`` steps."""


class SkipRateWarning(UserWarning):
    """The rolling skip rate went above ``alert_rate``."""


@dataclass
class MonitorRecord:
    """One step as the monitor saw it (the step-log row, plus the per-layer statistics)."""

    step: int
    lr: float | None
    grad_l2_pre_clip: float
    grad_l2_post_clip: float
    loss: float
    skipped: bool
    skip_reason: str
    scaler_scale: float | None
    """The scale this step used (None without a GradScaler)."""
    scale_after: float | None = None
    """The scale after this step's ``scaler.update()``."""
    skip_rate: float = 0.0
    """Rolling skip rate over the last ``window`` steps, this one included."""
    nonfinite_params: list[str] = field(default_factory=list)
    """Parameters whose gradient held NaN/Inf (all of them on recorded steps; else the first)."""
    nonfinite_count: int = 0
    """How many parameters had a non-finite gradient."""
    injected: str = ""
    """'inf:<param>' or 'spike' when the monitor injected a fault at this step."""
    stats: StepStats | None = None
    tripped: bool = False
    """Sentinel mode: this step tripped the sentinel (its full statistics were taken, and the next
    ``full_after`` steps are recorded in full)."""
    capture: str = ""
    """The capture folder written at this step ('' if none; see ``ampdoctor.engine.capture``)."""
    rank: int | None = None
    """Under torch.distributed: this process's rank."""
    ranks: RankView | None = None
    """Under torch.distributed: the ranks that saw a non-finite value at this step (the same on every rank)."""

    def row(self) -> dict[str, Any]:
        """The step-log row (standard columns, then ``EXTRA_COLUMNS``)."""
        names = self.nonfinite_params[:8]
        more = self.nonfinite_count - len(names)
        return {
            "step": self.step, "lr": self.lr, "grad_l2_pre_clip": self.grad_l2_pre_clip,
            "grad_l2_post_clip": self.grad_l2_post_clip, "loss": self.loss, "skipped": self.skipped,
            "skip_reason": self.skip_reason, "scaler_scale": self.scaler_scale, "scale_after": self.scale_after,
            "skip_rate": round(self.skip_rate, 6),
            "nonfinite_params": ";".join(names) + (f";+{more}" if more > 0 else ""), "injected": self.injected,
            **({"rank": self.rank, "ranks": self.ranks.column() if self.ranks is not None else ""}
               if self.rank is not None else {}),
        }


def _steps(v: int | Iterable[int] | None) -> set[int]:
    if v is None:
        return set()
    if isinstance(v, int):
        return {v}
    return {int(s) for s in v}


@dataclass(frozen=True)
class FirstFault:
    """The first step at which any rank saw a non-finite value, and who."""

    step: int
    rank: int
    kind: str
    """input | forward | loss | backward | grad (see ``engine.ranks.KINDS``)."""
    module: str | None
    others_clean: bool
    """No other rank saw it in its own batch, forward, loss or activation gradients: one rank's
    problem (a bad batch, a rank-local overflow), not every rank's."""
    ranks: str
    """Every rank that saw it, as the step log's ``ranks`` column."""

    def describe(self) -> str:
        where = f" in {self.module}" if self.module else ""
        who = (f"the other ranks were clean: rank {self.rank}'s own batch or forward" if self.others_clean
               else "other ranks saw it too: a range problem every rank shares")
        return f"step {self.step}: rank {self.rank} went non-finite first ({self.kind}{where}); {who} [{self.ranks}]"


@dataclass
class _Pending:
    """What ``after_backward`` learned, waiting for ``after_step``."""

    step: int
    m: Measured
    injected: str


class Monitor:
    """Watches a training loop: per-step CSV, skip reasons, rolling skip rate, scale history.

    Args:
        model: the model being trained (hooks go on every module; removed by ``close()``).
        optimizer: its optimizer; norms and clipping cover the optimizer's parameters. None for a
            loop that updates the weights by hand: use ``after_backward``/``after_step`` around it.
        scaler: a ``torch.amp.GradScaler`` (None, or a disabled one, for fp32/bf16 training).
        log: path of the step-log CSV (None: no file). Written line by line, flushed each line.
        log_mode: ``"append"`` (default: a resumed run appends; a fresh run refuses a log that
            already has rows), ``"new"`` (refuse an existing file) or ``"overwrite"``.
            See ``ampdoctor.watch.steplog``.
        max_norm: clip the global L2 gradient norm to this (None: measure only).
        window: steps in the rolling skip rate.
        alert_rate: warn (``SkipRateWarning`` and the ``ampdoctor`` logger) when the rolling skip
            rate goes above this, once ``alert_min_steps`` steps have run; re-armed when it drops.
        alert_min_steps: steps before the alert is judged (a few calibration skips are normal).
        max_skip_rate: raise ``SkipRateError`` when the rolling rate stays above this for
            ``patience`` consecutive steps (None: never). The step's row is written first.
        patience: see ``max_skip_rate``.
        every: per-layer statistics (``Hooks``) every ``every``-th step; the log row, norms and
            skip decision are taken every step regardless.
        activations: also record module outputs and the gradients at them (the expensive part);
            without them a skip is named from the parameter gradients alone.
        weights: also record every parameter's values each recorded step (off by default: a
            full extra pass over the weights; non-finite weights are caught through the
            gradients and the loss anyway).
        amp_dtype: the autocast dtype of ``autocast()``; default float16 with an enabled scaler,
            else no autocast.
        inject_inf_at: step(s) at which an Inf is written into a gradient (before ``unscale_``).
        inject_param: the parameter name to inject into (default: the first with a gradient).
        inject_spike_at: step(s) at which ``spike(target)`` multiplies the targets by ``spike_factor``.
        keep_stats: keep the ``StepStats`` in each returned record (per-layer rows, on the host).
        fsync: fsync the log after every line (survives a power cut, not just a killed process).
        capture: folder to write on the first failing step (model, optimizer and scaler state
            before it, the batches, RNG states, the last per-layer statistics), for
            ``ampdoctor triage SPEC --from FOLDER``; None: off. Pass each step's batch to
            ``step(loss, batch=...)`` (in the form your spec's dataloader yields) so it can be replayed.
        snapshot_every: with ``capture``, keep a host copy of the state every this many steps (and
            the batches since), to re-reach a step whose applied update broke the weights.
        capture_max_bytes: cap on the capture's size; what did not fit is named in its manifest.
        mode: ``"full"`` (per-layer statistics every ``every``-th step) or ``"sentinel"``, the
            always-on mode for long runs: every step, only a sentinel (each parameter gradient's
            L2 norm, which the monitor takes anyway: non-finite exactly when the gradient holds a
            NaN/Inf, and an upper bound of its absmax; carried in the step's one host copy) and no
            hook at all; full per-layer statistics every ``full_every`` steps, and from the step
            that trips the sentinel (a non-finite loss or gradient, or a gradient norm beyond the
            format's max) through the ``full_after`` steps after it. The step that trips gets the
            full statistics of its parameter gradients and weights (a second host copy, on that
            step only); its activations had passed unrecorded, the next steps' are recorded.
            See docs/own-loop.md.
        full_every: sentinel mode: full statistics on every ``full_every``-th step.
        full_after: sentinel mode: how many steps after a trip are recorded in full.
        first_step: the number of the first step (a resumed run, or a framework's global step).
        distributed: under ``torchrun`` / DDP (torch.distributed initialised, world size > 1): each
            rank writes its own log and capture (``steps.csv`` → ``steps.rank1.csv``), and one small
            all-reduce per step, inside the step's one host copy, tells every rank which rank saw a
            non-finite value first, in which module (``first_fault``; the log's ``ranks`` column).
            None: on when torch.distributed is initialised; False: off. Every rank must run the
            monitor (a monitor on rank 0 alone waits, warns and goes without). See docs/frameworks.md.
        process_group: the group of the exchange (default: the world).
        capture_ranks: ``"first"``: only the rank that went first writes a capture (rank 0 when no
            rank saw it locally); ``"all"``: every rank writes its own.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        log: str | Path | None = None,
        log_mode: Mode = "append",
        max_norm: float | None = None,
        window: int = 1000,
        alert_rate: float = 0.05,
        alert_min_steps: int = 100,
        max_skip_rate: float | None = None,
        patience: int = 100,
        every: int = 1,
        activations: bool = True,
        weights: bool = False,
        amp_dtype: torch.dtype | None = None,
        inject_inf_at: int | Iterable[int] | None = None,
        inject_param: str | None = None,
        inject_spike_at: int | Iterable[int] | None = None,
        spike_factor: float = 1e8,
        keep_stats: bool = True,
        fsync: bool = False,
        capture: str | Path | None = None,
        snapshot_every: int = 100,
        capture_max_bytes: int = DEFAULT_MAX_BYTES,
        mode: Literal["full", "sentinel"] = "full",
        full_every: int = 1000,
        full_after: int = 8,
        first_step: int = 0,
        distributed: bool | None = None,
        process_group: Any = None,
        capture_ranks: Literal["first", "all"] = "first",
    ) -> None:
        if window < 1:
            raise UsageError(f"window must be at least 1, got {window}")
        if max_norm is not None and not max_norm > 0:
            raise UsageError(f"max_norm must be positive, got {max_norm}")
        if max_skip_rate is not None and not 0 <= max_skip_rate < 1:
            raise UsageError(f"max_skip_rate must be in [0, 1), got {max_skip_rate}")
        if mode not in ("full", "sentinel"):
            raise UsageError(f"mode must be 'full' or 'sentinel', got {mode!r}")
        if full_every < 1 or full_after < 0:
            raise UsageError(f"full_every must be at least 1 and full_after at least 0, got {full_every}, {full_after}")
        self.mode = mode
        self.full_every = full_every
        self.full_after = full_after
        self._full_until = -1
        """Sentinel mode: steps before this one are recorded in full (set when the sentinel trips)."""
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._user_scaler = scaler
        self.max_norm = max_norm
        self.window = window
        self.alert_rate = alert_rate
        self.alert_min_steps = alert_min_steps
        self.max_skip_rate = max_skip_rate
        self.patience = patience
        self.keep_stats = keep_stats
        self.inject_inf_at = _steps(inject_inf_at)
        self.inject_spike_at = _steps(inject_spike_at)
        self.inject_param = inject_param
        self.spike_factor = spike_factor
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        if amp_dtype is None and self.scaler is not None:
            amp_dtype = torch.float16
        self.amp_dtype = amp_dtype
        named = unwrap(model)  # a compiled model: names without its ``_orig_mod.`` prefix
        if inject_param is not None and inject_param not in {n for n, _ in named.named_parameters()}:
            raise UsageError(f"inject_param {inject_param!r} is not a parameter of the model")
        self.hooks = Hooks(model, BF16 if amp_dtype == torch.bfloat16 else FP16, activations=activations, params=weights,
                           every=every)
        if mode == "sentinel":
            self.hooks.record_if = self._wants_full
        self.recipe = TrainStep(model, optimizer, self.scaler, hooks=self.hooks, max_norm=max_norm,
                                precision=Precision("monitor", autocast=amp_dtype, loss_scaling=self.scaler is not None),
                                sentinel=self.hooks.fmt.max if mode == "sentinel" else None)
        """The step recipe the monitor runs (the same one ``ampdoctor triage`` runs)."""
        self._params = self.recipe.params
        self._names = self.recipe.names
        self.ranks: RankExchange | None = None
        if distributed is not False:
            self.ranks = RankExchange.detect(self.recipe.modules, [self._names[id(p)] for p in self._params], process_group)
            if distributed and self.ranks is None:
                raise UsageError("distributed=True but torch.distributed is not initialised with more than one rank")
        self.recipe.ranks = self.ranks
        self.rank: int | None = self.ranks.rank if self.ranks is not None else None
        if self.rank is not None:
            log = rank_path(str(log), self.rank) if log else log
            capture = rank_path(str(capture), self.rank) if capture is not None else None
        if capture_ranks not in ("first", "all"):
            raise UsageError(f"capture_ranks must be 'first' or 'all', got {capture_ranks!r}")
        self.capture_ranks = capture_ranks
        self.first_fault: FirstFault | None = None
        """Under torch.distributed: the first step at which any rank saw a non-finite value (see ``FirstFault``)."""
        if snapshot_every < 1:
            raise UsageError(f"snapshot_every must be at least 1, got {snapshot_every}")
        self.capture: Capture | None = None
        if capture is not None:
            settings = {"max_norm": max_norm, "window": window, "alert_rate": alert_rate, "alert_min_steps": alert_min_steps,
                        "every": every, "activations": activations, "snapshot_every": snapshot_every}
            self.capture = Capture(Path(capture), model, optimizer, self.scaler, snapshot_every, capture_max_bytes, settings,
                                   str(amp_dtype).replace("torch.", "") if amp_dtype is not None else None)
        self._last_stats: StepStats | None = None
        self.log_path: Path | None = Path(log) if log else None
        """The step log this process writes (per rank under torch.distributed)."""
        self.writer = (StepLogWriter(log, extra_columns=EXTRA_COLUMNS + (RANK_COLUMNS if self.rank is not None else ()),
                                     mode=log_mode, fsync=fsync) if log else None)
        # counters and history (state_dict)
        if first_step < 0:
            raise UsageError(f"first_step must be at least 0, got {first_step}")
        if self.writer is not None:
            # a wrong log path fails now, not after the first step (rows already there: judged at the
            # first write, as a load_state_dict may yet continue the run)
            self.writer.check(first_step if first_step > 0 else None)
        self.step_num = first_step
        self.first_step = first_step
        self.total_skips = 0
        self._recent: deque[bool] = deque(maxlen=window)
        self._recent_skips = 0
        self._over = 0
        self._alerted = False
        self.scale_changes: list[tuple[int, float]] = []
        """(first step, scale) each time the scale used changed: the whole scale history, compactly."""
        self.skips: list[tuple[int, str]] = []
        """(step, reason) of every skipped step."""
        self._pending: _Pending | None = None
        self._spiked = False
        self._asked = False
        """``should_skip`` was read this step (a loop without a GradScaler skipping on it)."""
        self.last: MonitorRecord | None = None
        self._closed = False
        self.hooks.attach()
        self.hooks.begin_step(self.step_num)
        start_build()  # the one-pass statistics kernel, built by another process if not cached (watch.fused)

    # lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks and close the log. Safe to call twice."""
        self.hooks.detach()
        if self.writer is not None:
            self.writer.close()
        self._closed = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forward passes inside (evaluation) are not recorded into the next step's statistics."""
        self.hooks.detach()
        try:
            yield
        finally:
            self.hooks.attach()
            self.hooks.begin_step(self.step_num)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` on the model's device type with ``amp_dtype`` (disabled when None)."""
        return self.recipe.autocast()

    @property
    def skip_rate(self) -> float:
        """Rolling skip rate over the last ``window`` steps."""
        return self._recent_skips / len(self._recent) if self._recent else 0.0

    @property
    def should_skip(self) -> bool:
        """After ``after_backward``: whether this step must be skipped (non-finite loss or gradient)."""
        if self._pending is None:
            raise UsageError("should_skip is known after monitor.after_backward(loss)")
        self._asked = True
        return self._pending.m.skip

    # fault injection ---------------------------------------------------------------------------
    def spike(self, target: torch.Tensor) -> torch.Tensor:
        """``target * spike_factor`` at the steps in ``inject_spike_at``, else ``target`` unchanged."""
        if self.step_num in self.inject_spike_at:
            self._spiked = True
            return target * self.spike_factor
        return target

    def _inject_inf(self) -> str:
        if self.step_num not in self.inject_inf_at:
            return ""
        named = dict(unwrap(self.model).named_parameters())
        if self.inject_param is not None:
            p = named[self.inject_param]
            if p.grad is None:
                raise UsageError(f"cannot inject into {self.inject_param}: it has no gradient at step {self.step_num}")
            name = self.inject_param
        else:
            cands = [q for q in self._params if q.grad is not None]
            if not cands:
                raise UsageError(f"cannot inject an Inf at step {self.step_num}: no parameter has a gradient")
            p, name = cands[0], self._names[id(cands[0])]
        assert p.grad is not None
        with torch.no_grad():
            g = p.grad
            if g.dim() == 0:
                g.fill_(float("inf"))
            else:
                g[(0,) * g.dim()] = float("inf")
        return f"inf:{name}"

    # the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Gradient accumulation: the (scaled) backward of one micro-batch's loss, already divided by
        the number of micro-batches as loops do. After the last one call ``step()`` with no loss: the
        step's logged loss is the sum over its micro-batches (the full loss, not the last one's share)."""
        self.recipe.backward(loss)

    def step(self, loss: torch.Tensor | None = None, batch: Any = None) -> MonitorRecord:
        """One training step from a loss: backward, unscale_, clip, step or skip, update, zero_grad.

        ``batch``: this step's batch, kept (on the host) for the capture when ``capture`` is set.

        Returns the step's record; raises ``SkipRateError`` (after logging the step) when the skip
        rate has stayed above ``max_skip_rate`` for ``patience`` steps.
        """
        if self.optimizer is None:
            raise UsageError("Monitor without an optimizer cannot step: call monitor.after_backward(loss) after your "
                             "backward, update the weights yourself, then monitor.after_step()")
        if loss is not None:
            self.recipe.backward(loss)  # the loss check (on the device), then the scaled backward
        elif self.recipe._loss_sum is None:
            raise UsageError("step() without a loss: call monitor.backward(loss) for each micro-batch first")
        pend = self._after_backward(loss, batch)
        self.recipe.apply(pend.m)  # step or skip, scaler.update() on both paths
        self.recipe.zero_grad()
        return self._after_step(None, stacklevel=4)

    def note_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, for loops (and framework callbacks) that run backward themselves and
        call ``after_backward()`` with no loss: the step's logged loss is the sum of the noted ones,
        and a non-finite one skips the step (``nonfinite_loss``). No host sync."""
        self.recipe.note_loss(loss)

    def after_backward(self, loss: torch.Tensor | None = None, batch: Any = None) -> None:
        """Your own loop: call after ``scaler.scale(loss).backward()`` (and ``unscale_``, if you do it).

        Calls ``scaler.unscale_(optimizer)`` if you have not, injects faults, takes the global norm,
        clips (``max_norm``), queues the statistics and copies them to the host (the one sync).
        Then ``should_skip`` says whether the step must be skipped (GradScaler will skip it itself).
        """
        if loss is not None:
            self.recipe.note_loss(loss)
        self._after_backward(loss, batch)

    def _after_backward(self, loss: torch.Tensor | None, batch: Any = None) -> _Pending:
        if self._pending is not None:
            raise UsageError("after_backward called twice for one step; call after_step() in between")
        m, injected = self.recipe.measure(loss, before_unscale=self._inject_inf)
        if self._spiked:
            injected = (injected + ";" if injected else "") + "spike"
            self._spiked = False
        if self.mode == "sentinel" and (m.skip or (m.stats is None and m.tripped)):
            self._full_until = max(self._full_until, self.step_num + 1 + self.full_after)
            if m.stats is None:  # the tripping step passed unrecorded: take what is still there, in full
                st = self._trip_stats()
                m.stats = st
                if st.pgrad:
                    m.bad_params = [n for n, row in st.pgrad.items() if nonfinite(row) > 0]
                    m.bad_count = len(m.bad_params)
                    if m.skip and m.reason.startswith("nonfinite_grad"):
                        m.reason = self.recipe.grad_reason(st, m.bad_params)
        self._pending = _Pending(self.step_num, m, injected)
        if m.stats is not None:
            self._last_stats = m.stats
        if self.capture is not None:
            self.capture.before_update(self.step_num, batch)
        return self._pending

    # sentinel mode -----------------------------------------------------------------------------
    def _wants_full(self, step: int) -> bool:
        """Sentinel mode: whether ``step`` gets full per-layer statistics."""
        return step % self.full_every == 0 or step < self._full_until

    def _trip_stats(self) -> StepStats:
        """The sentinel tripped on a step not recorded: take what is still there in full now, the
        parameter gradients (and weights with ``weights=True``). A second host copy, on this step only."""
        h = self.hooks
        h.begin_step(self.step_num, record=True)
        h.after_backward()
        h.after_step()
        st = h.end_step()
        st.extra["sentinel_trip"] = 1.0
        return st

    def after_step(self, skipped: bool | None = None) -> MonitorRecord:
        """Your own loop: call after the optimizer step and ``scaler.update()``. No host sync.

        ``skipped`` defaults to what the step did: with a GradScaler, its verdict (exactly what the
        scaler did); without one, the monitor's verdict if you read ``should_skip`` this step (you
        skipped on it), else applied: a plain loop applies every step, and a non-finite one is logged
        as ``applied:<reason>``, not as a skip that did not happen.
        Writes the log row, updates the skip rate and history; may warn or raise (see the class).
        """
        if skipped is None and self.scaler is None and not self._asked:
            skipped = False
        return self._after_step(skipped, stacklevel=4)

    def _after_step(self, skipped: bool | None, stacklevel: int) -> MonitorRecord:
        pend = self._pending
        if pend is None:
            raise UsageError("call monitor.after_backward(loss) before monitor.after_step()")
        self._pending = None
        self._asked = False
        m = pend.m
        sk = m.skip if skipped is None else bool(skipped)
        reason = m.reason if sk else ""
        first = m.ranks.first if m.ranks is not None else None
        if sk and first is not None and first.rank != self.rank and first.local and not any(
                f.local for f in m.ranks.faults if f.rank == self.rank):  # type: ignore[union-attr]
            reason = f"nonfinite_from_rank:{first.rank}"  # clean here: the gradients came through DDP's all-reduce
        if not sk and m.skip:  # the caller applied a non-finite step (no GradScaler to skip it): say so
            reason = f"applied:{m.reason}"
        if sk and not reason:
            reason = "skipped_by_caller"
        # rolling skip rate
        if len(self._recent) == self.window and self._recent[0]:
            self._recent_skips -= 1
        self._recent.append(sk)
        self._recent_skips += int(sk)
        rate = self.skip_rate
        if sk:
            self.total_skips += 1
            self.skips.append((pend.step, reason))
        if m.scale is not None and (not self.scale_changes or self.scale_changes[-1][1] != m.scale):
            self.scale_changes.append((pend.step, m.scale))
        rec = MonitorRecord(
            pend.step, m.lr, m.grad_l2_pre_clip, m.grad_l2_post_clip, m.loss, sk, reason, m.scale,
            m.scale_after_if_skipped if sk else m.scale_after_if_applied, rate,
            m.bad_params, m.bad_count, pend.injected, m.stats if self.keep_stats else None,
            m.stats is not None and "sentinel_trip" in m.stats.extra, rank=self.rank, ranks=m.ranks,
        )
        if m.ranks is not None and m.ranks.faults and self.first_fault is None:
            self._note_first(pend.step, m.ranks)
        if self.writer is not None:
            self.writer.write(rec.row())
        self.last = rec
        self.step_num += 1
        if not self._closed:
            self.hooks.begin_step(self.step_num)
        if self.capture is not None and not self.capture.done:
            self._maybe_capture(rec, m, rate)
        self._judge_rate(rate, pend.step, stacklevel)
        return rec

    def _note_first(self, step: int, view: RankView) -> None:
        first = view.first
        assert first is not None
        self.first_fault = FirstFault(step, first.rank, first.kind, first.module, view.others_clean, view.column())
        if self.rank in (0, first.rank):  # not a line from each of a thousand ranks
            log.warning("ampdoctor: %s", self.first_fault.describe())

    def _maybe_capture(self, rec: MonitorRecord, m: Measured, rate: float) -> None:
        cap = self.capture
        assert cap is not None
        alert = (rate > self.alert_rate and self.step_num - self.first_step >= self.alert_min_steps and not self._alerted)
        trig = cap.judge(skipped=rec.skipped, reason=rec.skip_reason, scale=rec.scaler_scale, alert=alert, nonfinite=m.skip)
        if trig is None:
            return
        view = m.ranks
        extra: dict[str, Any] = {}
        if view is not None:
            first = view.first
            extra = {"ranks": view.column(), "first_rank": first.rank if first is not None else None,
                     "first_module": first.module if first is not None else None,
                     "others_clean": view.others_clean if first is not None else None}
            chosen = first.rank if first is not None else 0
            if self.capture_ranks == "first" and self.rank != chosen:
                cap.done = True  # this failing step is captured by rank `chosen`
                return
        before = None
        if self.scaler is not None:
            before = dict(self.scaler.state_dict())
            if m.scale is not None:
                before["scale"] = m.scale
            if m.growth_tracker is not None:
                before["_growth_tracker"] = m.growth_tracker
        out = cap.write(trig, step=rec.step, skipped=rec.skipped, record=rec.row(), stats=self._last_stats,
                        scaler_before=before, extra=extra)
        if out is not None:
            rec.capture = str(out)

    def _judge_rate(self, rate: float, step: int, stacklevel: int) -> None:
        n = len(self._recent)
        if rate > self.alert_rate and self.step_num - self.first_step >= self.alert_min_steps:
            if not self._alerted:
                self._alerted = True
                msg = (f"skip rate {rate:.1%} over the last {n} steps is above {self.alert_rate:.0%} (step {step}): "
                       "the model is in a range FP16 cannot hold; see the step log's skip_reason")
                log.warning(msg)
                warnings.warn(msg, SkipRateWarning, stacklevel=stacklevel)
        elif rate <= self.alert_rate:
            self._alerted = False
        if self.max_skip_rate is not None:
            self._over = self._over + 1 if rate > self.max_skip_rate else 0
            if self._over >= self.patience:
                raise SkipRateError(
                    f"skip rate {rate:.1%} over the last {n} steps stayed above max_skip_rate={self.max_skip_rate:g} "
                    f"for {self._over} steps (step {step}); last skip: {self.skips[-1][1] if self.skips else '?'}. "
                    "Run `ampdoctor scaler` on the step log, or `ampdoctor triage` on the model"
                )

    # history -----------------------------------------------------------------------------------
    def scale_history(self) -> tuple[list[int], list[float], list[bool]]:
        """(steps, scales used, skipped) for every step since the first, rebuilt from the compact history."""
        steps = list(range(self.first_step, self.step_num))
        skipped_set = {s for s, _ in self.skips}
        scales: list[float] = []
        ch = self.scale_changes
        j, cur = 0, ch[0][1] if ch else math.nan
        for s in steps:
            while j < len(ch) and ch[j][0] <= s:
                cur = ch[j][1]
                j += 1
            scales.append(cur)
        return steps, scales, [s in skipped_set for s in steps]

    def diagnose(self) -> ScaleDiagnosis:
        """Scale-history diagnosis of the run so far (needs a GradScaler)."""
        steps, scales, skipped = self.scale_history()
        if self.scaler is None or not self.scale_changes:
            return ScaleDiagnosis("empty", "no GradScaler: no scale history", 0, [], [], [])
        sc = self.scaler
        return diagnose_scale(scales, skipped, growth_interval=sc.get_growth_interval(),
                              backoff_factor=sc.get_backoff_factor(), steps=steps)

    def ledger(self) -> SkipLedger:
        """Which steps were skipped, why, and the runs of consecutive skips."""
        steps, scales, skipped = self.scale_history()
        reasons = dict(self.skips)
        return skip_ledger(skipped, [reasons.get(s, "") for s in steps],
                           scales if self.scaler is not None else None, steps)

    def state_dict(self) -> dict[str, Any]:
        """Counters and history, to save next to ``scaler.state_dict()`` in a checkpoint."""
        return {
            "version": STATE_VERSION,
            "step": self.step_num,
            "first_step": self.first_step,
            "total_skips": self.total_skips,
            "recent": list(self._recent),
            "over": self._over,
            "alerted": self._alerted,
            "scale_changes": [list(c) for c in self.scale_changes],
            "skips": [list(s) for s in self.skips],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters and history; the next step continues the step numbers (and the log)."""
        if self._pending is not None:
            raise UsageError("load_state_dict in the middle of a step")
        if state.get("version") != STATE_VERSION:
            raise UsageError(f"monitor state version {state.get('version')!r} is not {STATE_VERSION}")
        self.step_num = int(state["step"])
        self.first_step = int(state["first_step"])
        self.total_skips = int(state["total_skips"])
        self._recent = deque((bool(x) for x in state["recent"]), maxlen=self.window)
        self._recent_skips = sum(self._recent)
        self._over = int(state["over"])
        self._alerted = bool(state["alerted"])
        self.scale_changes = [(int(s), float(v)) for s, v in state["scale_changes"]]
        self.skips = [(int(s), str(r)) for s, r in state["skips"]]
        self.hooks.begin_step(self.step_num)


__all__ = ["EXTRA_COLUMNS", "RANK_COLUMNS", "FirstFault", "Monitor", "MonitorRecord", "SkipRateError", "SkipRateWarning"]
