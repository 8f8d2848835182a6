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
import os
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ampdoctor.engine.capture import (
    DEFAULT_MAX_BYTES,
    NORMAL_SKIPS,
    Capture,
    CaptureWarning,
    FailingStep,
    Trigger,
    sharded_engine,
)
from ampdoctor.engine.ranks import OFF, SLOTS, RankExchange, RankView, rank_path
from ampdoctor.engine.ring import OPTIMIZER_EVERY, SPIKE_WINDOW, Lookback, RingFigures
from ampdoctor.engine.shards import Shards
from ampdoctor.engine.step import Measured, Precision, TrainStep
from ampdoctor.errors import AmpDoctorError, UsageError
from ampdoctor.formats import BF16, FP16
from ampdoctor.input.batches import Micro, named_tensors
from ampdoctor.judge.history import DEFAULT_HORIZON
from ampdoctor.judge.scaler import SkipLedger, skip_ledger
from ampdoctor.notify import alert, say
from ampdoctor.records import StepStats, nonfinite
from ampdoctor.report.scaler import ScaleDiagnosis, diagnose_scale, no_scale_history
from ampdoctor.report.words import spike_message
from ampdoctor.watch import fused, userhooks
from ampdoctor.watch.fused import start_build
from ampdoctor.watch.hooks import Hooks, local, named_parameters, unwrap
from ampdoctor.watch.ring import DEFAULT_STEPS, LAYERS_FILE, STEPS_FILE
from ampdoctor.watch.steplog import Mode, StepLogWriter
from ampdoctor.watch.tap import ForwardTap

log = logging.getLogger("ampdoctor")  # heard on stderr until the application configures logging (ampdoctor.notify)

EXTRA_COLUMNS: tuple[str, ...] = ("scale_after", "skip_rate", "nonfinite_params", "injected")
"""Columns the monitor writes after the standard ones (see ``steplog.COLUMNS``)."""
CAPTURE_COLUMNS: tuple[str, ...] = ("capture_held_bytes",)
"""With a capture armed, after ``EXTRA_COLUMNS``: the host bytes it holds after the step (its last snapshot
and the batches since; bounded by ``capture_hold_bytes``)."""
RANK_COLUMNS: tuple[str, ...] = ("rank", "ranks")
"""Under torch.distributed, after ``EXTRA_COLUMNS``: this rank, and every rank that saw a non-finite
value at the step as ``rank:kind:module`` (``engine.ranks.RankView.column``), the same on every rank."""
STEP_COLUMNS: tuple[str, ...] = ("step_convention",)
"""Under a framework, after ``EXTRA_COLUMNS``: which number the ``step`` column is (``STEP_CONVENTIONS``)."""
STEP_CONVENTIONS: dict[str, int] = {
    "monitor": 0,
    "trainer_global_step": 1,
    "lightning_global_step": 0,
}
"""What a step log's ``step`` counts, and the number of a fresh run's first step:

- ``monitor``: the monitor's own count of optimizer steps, from ``first_step`` (a loop of your own, accelerate);
- ``trainer_global_step``: the transformers Trainer's ``state.global_step`` after the step, the ``step`` its
  log history gives the step and the N of the ``checkpoint-N`` saved after it (a fresh run's first step is 1);
- ``lightning_global_step``: Lightning's ``trainer.global_step`` while the step runs (before its optimizer
  step), which is the ``step`` its loggers (CSVLogger's ``metrics.csv``) give what the step logged.

A log without the ``step_convention`` column counts as ``monitor`` does."""
STATE_VERSION = 1


class SkipRateError(AmpDoctorError):
    """The rolling skip rate stayed above ``max_skip_rate`` for ``patience`` steps."""


class SkipRateWarning(UserWarning):
    """The rolling skip rate went above ``alert_rate``."""


class MonitorOffWarning(UserWarning):
    """Something inside ampdoctor failed, or the setup is one it cannot read correctly: the monitor turned
    itself off and the training goes on without it."""


UNSUPPORTED = {
    "deepspeed": "DeepSpeed",
}
"""Sharding engines the monitor cannot read correctly yet: it turns itself off on them, with one warning."""
SHARDED = {
    "fsdp1": "FSDP1 (FullyShardedDataParallel)",
    "fsdp2": "FSDP2 (fully_shard)",
    "tensor_parallel": "tensor parallelism (DTensor parameters)",
}
"""Sharding engines read through their pieces (``engine.shards``): norms and rows reduced across the ranks."""


def _dist_rank() -> tuple[int, int]:
    """(rank, world size) of torch.distributed's default group, (0, 1) when it is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Unreadable(Exception):
    """The setup is one the monitor cannot read correctly (a sharded layout it does not reduce yet)."""


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
    capture_held: int | None = None
    """With a capture armed: the host bytes it holds after this step."""
    step_convention: str | None = None
    """Under a framework: what ``step`` counts (``STEP_CONVENTIONS``)."""

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
            **({"capture_held_bytes": self.capture_held} if self.capture_held is not None else {}),
            **({"step_convention": self.step_convention} if self.step_convention is not None else {}),
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
    spread: bool = False
    """Tensor parallelism: the other ranks went bad too, later in the forward, through a collective."""

    def describe(self) -> str:
        where = f" in {self.module}" if self.module else ""
        who = (f"the other ranks went non-finite later in the forward, through a collective: rank {self.rank}'s own "
               "computation" if self.spread else
               f"the other ranks were clean: rank {self.rank}'s own batch or forward" if self.others_clean
               else "other ranks saw it too: a range problem every rank shares")
        return f"step {self.step}: rank {self.rank} went non-finite first ({self.kind}{where}); {who} [{self.ranks}]"


def _check_types(model: Any, optimizer: Any, scaler: Any) -> None:
    """Misuse of the constructor is a ``UsageError`` naming the argument, at once."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model: Monitor takes the nn.Module you train, got {type(model).__name__}")
    if optimizer is not None and not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "step")):
        raise UsageError(f"optimizer: Monitor takes a torch.optim.Optimizer (or None), got {type(optimizer).__name__}")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("scale", "unscale_", "update", "is_enabled")):
        raise UsageError(f"scaler: Monitor takes a torch.amp.GradScaler (or None), got {type(scaler).__name__}")


def _check_loss(loss: Any, where: str) -> None:
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"{where}(loss): the loss must be the tensor you call .backward() on, got {type(loss).__name__}")


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
        capture_hold_bytes: what the capture may hold on the host between snapshots (its last snapshot
            and the batches since); past it a snapshot is taken early. Default: a thirty-second of the
            machine's RAM, never more than ``capture_max_bytes``. The step log's ``capture_held_bytes``
            says what it holds.
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
        capture_on: ``"failure"``: the capture, the first-failure message and the skip-rate alert leave
            out GradScaler's normal skips (calibration, growth probes, an isolated overflow; see
            ``engine.capture.FailingStep``); ``"skip"``: every skip of non-finite gradients is a failure.
        quiet: keep this monitor's events (the first failure, the capture, the alert, turning off) off
            the terminal; they still go to the ``ampdoctor`` logger (see ``ampdoctor.notify``).
        step_convention: what the step numbers count (``STEP_CONVENTIONS``; the framework integrations set
            it): the log gets a ``step_convention`` column and the capture's manifest says it. None: the
            monitor's own count, no column.
        ring: steps the lookback ring keeps (``engine.ring``: per-step scalars, and per-layer figures of the
            recorded steps, in a fixed host buffer filled from the step's one host copy); the capture writes
            it and the report tells the steps before the failure from it. 0: no ring (and no forecast or spike).
        forecast_horizon: warn once (``ForecastWarning``) when a layer's output is on course to pass the format's
            max within this many steps (``judge.history.forecast``; docs/diagnosis.md). None: no forecast.
        spike_sigmas: a loss or gradient norm more than this many robust standard deviations above the median
            of the ``spike_window`` applied steps before it is a failure: said, captured, and the layers whose
            update norms spiked first named. None (default): off. See docs/long-runs.md.
        spike_window: see ``spike_sigmas``.
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
        capture_on: Literal["failure", "skip"] = "failure",
        capture_hold_bytes: int | None = None,
        quiet: bool = False,
        step_convention: str | None = None,
        ring: int = DEFAULT_STEPS,
        forecast_horizon: int | None = DEFAULT_HORIZON,
        spike_sigmas: float | None = None,
        spike_window: int = SPIKE_WINDOW,
    ) -> None:
        _check_types(model, optimizer, scaler)
        self.quiet = quiet
        self._off: str | None = None
        """Why the monitor is off (it failed, or cannot read this setup); None while it watches."""
        self._owe_exchange = False
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.max_norm = max_norm
        self.step_num = first_step
        self.first_step = first_step
        self.step_convention = step_convention
        self.first_fault: FirstFault | None = None
        """Under torch.distributed: the first step at which any rank saw a non-finite value (see ``FirstFault``)."""
        self.first_failure: tuple[int, str] | None = None
        """(step, reason) of the run's first failing step (see ``engine.capture.FailingStep``)."""
        self.last: MonitorRecord | None = None
        self._pending: _Pending | None = None
        self._closed = False
        self._accumulated = False
        self._micro: list[Any] = []
        """Micro-batches given to ``backward``/``note_loss`` this step (for the capture)."""
        self.ranks: RankExchange | None = None
        self.rank: int | None = None
        self.capture: Capture | None = None
        self.tap: ForwardTap | None = None
        self.writer: StepLogWriter | None = None
        self.lookback: Lookback | None = None
        """The lookback ring, its forecast and its spike trigger (None with ``ring=0``)."""
        self.log_path: Path | None = None
        self.total_skips = 0
        self._recent: deque[bool] = deque(maxlen=max(int(window), 1))
        self._recent_skips = 0
        self._recent_counted: deque[bool] = deque(maxlen=max(int(window), 1))
        self._counted_skips = 0
        self._over = 0
        self._alerted = False
        self.scale_changes: list[tuple[int, float]] = []
        """(first step, scale) each time the scale used changed: the whole scale history, compactly."""
        self.skips: list[tuple[int, str]] = []
        """(step, reason) of every skipped step."""
        self.engine = sharded_engine(unwrap(model))
        """The sharding engine holding the model (``engine.capture.sharded_engine``), None for a whole model."""
        if self.engine in UNSUPPORTED:
            if max_norm is not None:
                raise UsageError(f"max_norm: under {UNSUPPORTED[self.engine]} clip with the engine's own clip_grad_norm_")
            self._turn_off(f"{UNSUPPORTED[self.engine]} is not supported yet: ampdoctor cannot read its sharded "
                           "gradients correctly, so it watches nothing of this run", warn=True, who=0)
            return

        def setup() -> None:
            """Everything built once the setup is known to be one the monitor can watch (a closure: the
            arguments above, one signature)."""
            nonlocal log, capture, amp_dtype
            if step_convention is not None and step_convention not in STEP_CONVENTIONS:
                raise UsageError(f"step_convention must be one of {', '.join(STEP_CONVENTIONS)}, got {step_convention!r}")
            fresh = STEP_CONVENTIONS.get(step_convention or "monitor", 0)
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
            self._warming = False
            """Full mode while the statistics kernel builds: sentinel checks only, until it is ready."""
            self._user_scaler = scaler
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
            if inject_param is not None and inject_param not in {n for n, _ in named_parameters(named)}:
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
            if distributed is not False:
                self.ranks = RankExchange.detect(self.recipe.modules, [self._names[id(p)] for p in self._params], process_group)
                if distributed and self.ranks is None:
                    raise UsageError("distributed=True but torch.distributed is not initialised with more than one rank")
            self.recipe.ranks = self.ranks
            self.rank = self.ranks.rank if self.ranks is not None else None
            if self.engine in SHARDED:
                rx = self.ranks
                rank, world = (rx.rank, rx.world) if rx is not None else _dist_rank()
                self.recipe.shards = sh = Shards(self.engine, model, self._params, rank, world)
                if rx is not None:
                    rx.by_position = self.engine == "tensor_parallel"  # ranks share a batch: order by the forward
                    rx.derived_inputs = self.engine in ("fsdp1", "fsdp2")  # (their mixed precision casts the batch)
                if sh.problem is not None:
                    raise _Unreadable(f"{SHARDED[self.engine]} over {sh.problem} is not supported yet")
            if self.rank is not None:
                log = rank_path(str(log), self.rank) if log else log
                capture = rank_path(str(capture), self.rank) if capture is not None else None
            if capture_ranks not in ("first", "all"):
                raise UsageError(f"capture_ranks must be 'first' or 'all', got {capture_ranks!r}")
            self.capture_ranks = capture_ranks
            if snapshot_every < 1:
                raise UsageError(f"snapshot_every must be at least 1, got {snapshot_every}")
            if capture is not None:
                settings = {"max_norm": max_norm, "window": window, "alert_rate": alert_rate, "alert_min_steps": alert_min_steps,
                            "every": every, "activations": activations, "snapshot_every": snapshot_every,
                            "step_convention": step_convention or "monitor"}
                self.capture = Capture(Path(capture), model, optimizer, self.scaler, snapshot_every, capture_max_bytes, settings,
                                       str(amp_dtype).replace("torch.", "") if amp_dtype is not None else None,
                                       quiet=quiet, sharded=self.engine, hold_bytes=capture_hold_bytes or 0,
                                       layout=self.recipe.shards.layout(model) if self.recipe.shards is not None else None)
            if capture_on not in ("failure", "skip"):
                raise UsageError(f"capture_on must be 'failure' or 'skip', got {capture_on!r}")
            if self.capture is not None:
                self.capture.step_starts(first_step)
            self._failing = FailingStep(self.scaler.get_growth_interval() if self.scaler is not None else 2000,
                                        every_skip=capture_on == "skip")
            self._recent_counted = deque(maxlen=window)
            """Per step of the window: a skip that counts for the alert (not GradScaler's calibration or probe)."""
            self.tap = (ForwardTap(model, None, inputs=True, on_start=self._forward_starts) if capture is not None else None)
            if self.tap is not None:
                self.tap.on_error = self._hook_failed
            """With a capture: the model's own inputs of each step's training forwards (the batch, without ``batch=``)."""
            self._batch_checked = False
            self._last_stats: StepStats | None = None
            self.log_path = Path(log) if log else None
            """The step log this process writes (per rank under torch.distributed)."""
            self.writer = (StepLogWriter(log, extra_columns=EXTRA_COLUMNS + (CAPTURE_COLUMNS if self.capture is not None else ())
                                         + (RANK_COLUMNS if self.rank is not None else ())
                                         + (STEP_COLUMNS if step_convention is not None else ()),
                                         mode=log_mode, fsync=fsync, fresh_step=fresh) if log else None)
            # counters and history (state_dict)
            if first_step < 0:
                raise UsageError(f"first_step must be at least 0, got {first_step}")
            if self.writer is not None:
                # a wrong log path fails now, not after the first step (rows already there: judged at the
                # first write, as a load_state_dict may yet continue the run)
                self.writer.check(first_step if first_step > fresh else None)
            self._spiked = False
            self._asked = False
            """``should_skip`` was read this step (a loop without a GradScaler skipping on it)."""
            if self.engine in SHARDED and self.rank in (None, 0):
                self._say_sharded(scaler)
            self.lookback = self._lookback(ring, forecast_horizon, spike_sigmas, spike_window)
            self.hooks.on_error = self._hook_failed
            self.hooks.attach()
            self.hooks.begin_step(self.step_num)
            start_build()  # the one-pass statistics kernel, built by another process if not cached (watch.fused)
            self._warming = self._warm_start()

        try:
            setup()
        except _Unreadable as e:  # a layout the monitor cannot read: off with one warning (rank 0), training goes on
            self.close()  # (every rank finds the same layout: none of them joins an exchange)
            self._turn_off(f"{e}: ampdoctor cannot read its sharded gradients correctly, so it watches nothing of "
                           "this run", warn=True, who=0)
        except AmpDoctorError:  # misuse, a log that must not be overwritten: the user's to fix, at once
            self.close()
            raise
        except Exception as e:  # something of ampdoctor's: off, with one warning; the training is not stopped
            self.close()
            self._fail("setting up the monitor", e)  # (an exchange already agreed on is joined once, flagged off)

    # lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks and close the log. Safe to call twice; never raises."""
        self._closed = True
        for part in ("tap", "hooks", "writer"):
            obj = getattr(self, part, None)
            if obj is None:
                continue
            try:
                obj.close() if part != "hooks" else obj.detach()
            except Exception:  # pragma: no cover - closing must not break the user's exit
                pass

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forward passes inside (evaluation) are not recorded into the next step's statistics."""
        if self._off is not None:
            yield
            return
        self.hooks.detach()
        try:
            yield
        finally:
            if self._off is None and not self._closed:
                self.hooks.attach()
                self.hooks.begin_step(self.step_num)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` on the model's device type with ``amp_dtype`` (disabled when None)."""
        if self._off is not None and not hasattr(self, "recipe"):
            return contextlib.nullcontext()
        return self.recipe.autocast()

    @property
    def skip_rate(self) -> float:
        """Rolling skip rate over the last ``window`` steps."""
        recent = getattr(self, "_recent", None)
        return self._recent_skips / len(recent) if recent else 0.0

    @property
    def off(self) -> str | None:
        """Why the monitor turned itself off (an internal failure, or a setup it cannot read); None while on."""
        return self._off

    @property
    def should_skip(self) -> bool:
        """After ``after_backward``: whether this step must be skipped (non-finite loss or gradient).
        False once the monitor is off (``off``): the loop then runs as it would without it."""
        if self._off is not None:
            return False
        if self._pending is None:
            raise UsageError("should_skip is known after monitor.after_backward(loss)")
        self._asked = True
        return self._pending.m.skip

    def _say_sharded(self, scaler: Any) -> None:
        """Under a sharding engine, once (rank 0): what the log's norms are, and a scaler that lets the ranks drift."""
        name = SHARDED[self.engine or ""]
        if not self.recipe.reduced:
            say(f"ampdoctor: {name}: each rank holds a shard of the gradients and this monitor exchanges nothing with "
                "the other ranks (distributed=False), so the step log leaves the gradient norms out", quiet=self.quiet)
        if (self.engine == "fsdp1" and self.scaler is not None and type(scaler).__name__ != "ShardedGradScaler"
                and self.recipe.ranks is not None):  # (DTensor gradients: GradScaler's found-inf is all-reduced already)
            msg = (f"ampdoctor: {name} with a plain GradScaler: each rank decides its skip from its own shard of the "
                   "gradients, so the ranks' loss scales can drift apart; use "
                   "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which agrees across ranks")
            alert(msg, RuntimeWarning, quiet=self.quiet)

    # failing safe ------------------------------------------------------------------------------
    def _turn_off(self, why: str, *, warn: bool, who: int | None = None) -> None:
        """Turn the monitor off for the rest of the run: hooks, tap and the exchange go; the log is closed.
        ``warn``: say it (once, on this rank; ``who``: only on that rank)."""
        if self._off is not None:
            return
        self._off = why
        self._pending = None
        for part in ("tap", "hooks"):
            obj = getattr(self, part, None)
            if obj is not None:
                try:
                    obj.close() if part == "tap" else obj.detach()
                except Exception:
                    pass
        w = getattr(self, "writer", None)
        if w is not None:
            try:
                w.close()
            except Exception:
                pass
        rank = getattr(self, "rank", None)
        if rank is None and who is not None:  # (before the exchange exists: the process group's rank)
            try:
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
            except Exception:
                rank = None
        if warn and (who is None or rank is None or who == rank):
            where = f" (rank {rank})" if rank is not None and who is None else ""  # (who: said for every rank)
            msg = f"ampdoctor{where}: {why}; the monitor is off and the training goes on without it"
            alert(msg, MonitorOffWarning, quiet=self.quiet)

    def _fail(self, where: str, exc: BaseException) -> None:
        """Something of ampdoctor's raised: off, with one warning naming the step and what failed. Under
        torch.distributed the other ranks learn it at the next exchange (this rank still joins it once)."""
        if self._off is not None:
            return
        rx = getattr(self, "ranks", None)
        if rx is not None:
            self._owe_exchange = True
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        self._turn_off(f"{where} failed at step {self.step_num} ({type(exc).__name__}{': ' + detail if detail else ''})",
                       warn=True)

    def _forward_starts(self) -> None:
        if self.capture is not None and self._pending is None:
            self.capture.step_starts(self.step_num, forward=True)

    def _hook_failed(self, exc: BaseException) -> None:
        self._fail("recording the forward", exc)

    def _pay_exchange(self) -> None:
        """A rank that turned off joins the exchange once more, flagged off, so that no rank waits in a
        collective it alone would run; after it every rank is off. Never raises."""
        rx = getattr(self, "ranks", None)
        self._owe_exchange = False
        if rx is None:
            return
        self.ranks = None
        self.recipe.ranks = None
        try:
            row = torch.zeros(SLOTS, dtype=torch.float64, device=self.device)
            row[0] = OFF
            sh = self.recipe.shards
            if sh is None:
                rx.exchange(row).cpu()
            else:  # the same collectives as the others' at this step (a recorded step reduces rows too)
                ns, nm = sh.sizes(self._scheduled(self.step_num))
                rx.exchange(row, torch.zeros(ns, dtype=torch.float64, device=self.device),
                            torch.full((nm,), -math.inf, dtype=torch.float64, device=self.device) if nm else None).cpu()
        except Exception:  # pragma: no cover - the collective itself broke: nothing more to join
            pass

    def _blank(self) -> MonitorRecord:
        """The record of a step taken while the monitor is off (no measurement)."""
        rec = MonitorRecord(self.step_num, None, math.nan, math.nan, math.nan, False, "", None,
                            rank=getattr(self, "rank", None))
        self.step_num += 1
        return rec

    def _plain_step(self, loss: torch.Tensor | None) -> MonitorRecord:
        """``step()`` once the monitor is off: PyTorch's AMP recipe, nothing of ampdoctor's."""
        opt, sc = self.optimizer, self.scaler
        assert opt is not None
        if loss is not None:
            (sc.scale(loss) if sc is not None else loss).backward()
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if sc is not None:
            if self.max_norm is not None:
                try:
                    sc.unscale_(opt)
                except RuntimeError:  # already unscaled this step (the failure came after it)
                    pass
                torch.nn.utils.clip_grad_norm_(params, self.max_norm)
            sc.step(opt)
            sc.update()
        else:
            if self.max_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, self.max_norm)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return self._blank()

    # fault injection ---------------------------------------------------------------------------
    def spike(self, target: torch.Tensor) -> torch.Tensor:
        """``target * spike_factor`` at the steps in ``inject_spike_at``, else ``target`` unchanged."""
        if self._off is None and self.step_num in self.inject_spike_at:
            self._spiked = True
            return target * self.spike_factor
        return target

    def _inject_inf(self) -> str:
        if self.step_num not in self.inject_inf_at:
            return ""
        named = dict(named_parameters(unwrap(self.model)))
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
            g = local(p.grad)
            if g.numel() == 0:  # this rank holds an empty slice of it
                return ""
            if g.dim() == 0:
                g.fill_(float("inf"))
            else:
                g[(0,) * g.dim()] = float("inf")
        return f"inf:{name}"

    # the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, batch: Any = None) -> None:
        """Gradient accumulation: the (scaled) backward of one micro-batch's loss, already divided by
        the number of micro-batches as loops do. After the last one call ``step()`` with no loss: the
        step's logged loss is the sum over its micro-batches (the full loss, not the last one's share).

        ``batch``: this micro-batch (in the form your spec's dataloader yields), kept for the capture;
        the step's micro-batches are kept together and replay as one accumulated step."""
        _check_loss(loss, "backward")
        self._keep_micro(batch)
        if self._off is None:
            try:
                self.recipe.note_loss(loss)
            except Exception as e:
                self._fail("the loss check", e)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self._accumulated = True

    def step(self, loss: torch.Tensor | None = None, batch: Any = None) -> MonitorRecord:
        """One training step from a loss: backward, unscale_, clip, step or skip, update, zero_grad.

        ``batch``: this step's batch, kept (on the host) for the capture when ``capture`` is set;
        without it the capture keeps the model's own inputs of the step's forward.

        The monitor owns this step and runs PyTorch's AMP recipe; should anything of ampdoctor's fail,
        it warns once, turns itself off and still takes the step (see ``off``).

        Returns the step's record; raises ``SkipRateError`` (after logging the step) when the skip
        rate has stayed above ``max_skip_rate`` for ``patience`` steps.
        """
        if self.optimizer is None:
            raise UsageError("Monitor without an optimizer cannot step: call monitor.after_backward(loss) after your "
                             "backward, update the weights yourself, then monitor.after_step()")
        if loss is not None:
            _check_loss(loss, "step")
        elif not self._accumulated:
            raise UsageError("step() without a loss: call monitor.backward(loss) for each micro-batch first")
        self._accumulated = False
        batch = self._step_batch(batch)
        if self._off is not None:
            return self._plain_step(loss)
        if loss is not None:
            try:
                self.recipe.note_loss(loss)  # the loss check, on the device
            except Exception as e:
                self._fail("the loss check", e)
                return self._plain_step(loss)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        pend = self._after_backward(loss, batch, observe=False)
        if pend is None:  # it failed: the step goes on without the monitor
            return self._plain_step(None)
        self.recipe.apply(pend.m)  # step or skip, scaler.update() on both paths
        self.recipe.zero_grad()
        return self._guarded_after_step(None)

    def note_loss(self, loss: torch.Tensor, batch: Any = None) -> None:
        """A micro-batch's loss, for loops (and framework callbacks) that run backward themselves and
        call ``after_backward()`` with no loss: the step's logged loss is the sum of the noted ones,
        and a non-finite one is logged (``nonfinite_loss``). No host sync. ``batch``: that micro-batch,
        kept for the capture (see ``backward``)."""
        _check_loss(loss, "note_loss")
        self._keep_micro(batch)
        if self._off is not None:
            return
        try:
            self.recipe.note_loss(loss)
        except Exception as e:
            self._fail("the loss check", e)

    def note_clip(self, total_norm: Any) -> None:
        """The total norm your loop's (or a framework's) ``clip_grad_norm_`` returned for this step, before
        it clipped: the log's ``grad_l2_pre_clip`` is that value, and ``grad_l2_post_clip`` the norm the
        monitor measures at ``after_backward`` (after the clip). Read only, in the step's one host copy; a
        tensor is kept as it is (never written). Without it both are the norm ``after_backward`` sees."""
        if self._off is not None or total_norm is None:
            return
        if not isinstance(total_norm, (torch.Tensor, int, float)) or isinstance(total_norm, bool):
            raise UsageError(f"note_clip takes the norm clip_grad_norm_ returned (a tensor or a float), not "
                             f"{type(total_norm).__name__}")
        if isinstance(total_norm, torch.Tensor) and total_norm.numel() != 1:
            raise UsageError(f"note_clip takes one total norm, not a tensor of {total_norm.numel()} values")
        self.recipe.clip_norm = total_norm

    def after_backward(self, loss: torch.Tensor | None = None, batch: Any = None) -> None:
        """Your own loop: call after ``scaler.scale(loss).backward()`` (and after ``unscale_`` and your
        clipping, if you do them), before ``scaler.step``.

        Observes only: it writes nothing your training reads (no ``unscale_``, no clip, no write to the
        gradients or to GradScaler): the gradients' norms and statistics are taken as ``unscale_``
        would make them, and the step's skip is the one GradScaler will make. It queues the
        statistics and copies them to the host (the one sync). Then ``should_skip`` says whether the
        step holds a non-finite loss or gradient (a loop without a GradScaler can skip on it).
        """
        if loss is not None:
            _check_loss(loss, "after_backward")
        batch = self._step_batch(batch)
        if self._owe_exchange:
            self._pay_exchange()
        if self._off is not None:
            return
        if loss is not None:
            try:
                self.recipe.note_loss(loss)
            except Exception as e:
                self._fail("the loss check", e)
                self._pay_exchange()
                return
        self._after_backward(loss, batch, observe=True)

    def _keep_micro(self, batch: Any) -> None:
        if batch is not None and self.capture is not None and not self.capture.done:
            self._micro.append(batch)

    def _step_batch(self, batch: Any) -> Any:
        """The step's batch for the capture: the one given, or the micro-batches given to ``backward`` /
        ``note_loss`` (kept together: ``MicroBatches``)."""
        micro, self._micro = self._micro, []
        if micro and batch is not None:
            raise UsageError("the step's micro-batches were given to backward()/note_loss(); give the step no batch= "
                             "(or pass ampdoctor.MicroBatches([...]) to it and none to backward)")
        if micro:
            return Micro(micro) if len(micro) > 1 else micro[0]
        return batch

    def _after_backward(self, loss: torch.Tensor | None, batch: Any, observe: bool) -> _Pending | None:
        """The measurement at the step's one host copy; None when it failed (the monitor is then off, and
        under torch.distributed this rank has joined the step's exchange all the same)."""
        if self._pending is not None:
            raise UsageError("after_backward called twice for one step; call after_step() in between")
        rx = self.ranks
        calls = rx.calls if rx is not None else 0
        try:
            return self._measure(loss, batch, observe)
        except (UsageError, SkipRateError):
            raise
        except Exception as e:
            self._fail("measuring the step", e)
            if rx is not None and rx.calls == calls:  # this step's exchange is still to be joined
                self._pay_exchange()
            return None

    def _measure(self, loss: torch.Tensor | None, batch: Any, observe: bool) -> _Pending | None:
        m, injected = self.recipe.measure(loss, before_unscale=self._inject_inf, observe=observe)
        if m.ranks is not None and m.ranks.off:  # a rank's monitor failed: every rank turns off, here and now
            self.ranks = self.recipe.ranks = None
            self._turn_off(f"the monitor of rank {m.ranks.off[0]} failed (its warning says what), so every rank's is off "
                           f"from step {self.step_num}", warn=True, who=0)
            return None
        if self._spiked:
            injected = (injected + ";" if injected else "") + "spike"
            self._spiked = False
        trip = m.skip or (m.stats is None and m.tripped)
        if self.recipe.shards is not None and m.ranks is not None:  # the same on every rank: their collectives agree
            trip = bool(m.ranks.faults) or m.tripped
        if (self.mode == "sentinel" or self._warming) and trip:
            self._full_until = max(self._full_until, self.step_num + 1 + self.full_after)
            if m.stats is None:  # the tripping step passed unrecorded: take what is still there, in full
                st = self._trip_stats(1.0 / m.scale if self.recipe.grads_scaled and m.scale else None)
                m.stats = st
                if st.pgrad:
                    m.bad_params = [n for n, row in st.pgrad.items() if nonfinite(row) > 0]
                    m.bad_count = len(m.bad_params)
                    if m.skip and m.reason.startswith("nonfinite_grad"):
                        m.reason = self.recipe.grad_reason(st, m.bad_params)
        if not observe:
            m.will_skip = m.skip
        self._pending = _Pending(self.step_num, m, injected)
        if m.stats is not None:
            self._last_stats = m.stats
        cap = self.capture
        if cap is not None and not cap.done:
            taken = self.tap.take() if self.tap is not None else None
            b = batch if batch is not None else taken
            if not self._batch_checked:
                self._batch_checked = True
                if b is None or not named_tensors(b):
                    msg = (f"ampdoctor: the capture armed at {cap.path} has no batch to keep at step {self.step_num}: "
                           "no batch= was passed and no training call of the model itself was seen; pass "
                           "batch= to mon.step() or mon.after_backward(), or a failure cannot be replayed")
                    alert(msg, CaptureWarning, quiet=self.quiet)
            cap.before_update(self.step_num, b)
        return self._pending

    # the lookback ring --------------------------------------------------------------------------
    def _lookback(self, steps: int, horizon: int | None, sigmas: float | None, window: int) -> Lookback | None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise UsageError(f"ring must be a number of steps (0: off), got {steps!r}")
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
            raise UsageError(f"forecast_horizon must be a number of steps of at least 1 (None: off), got {horizon!r}")
        if sigmas is not None and not (isinstance(sigmas, (int, float)) and not isinstance(sigmas, bool) and sigmas > 0):
            raise UsageError(f"spike_sigmas must be a positive number of robust standard deviations (None: off), got {sigmas!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 16:
            raise UsageError(f"spike_window must be at least 16 steps, got {window!r}")
        if steps == 0:
            if sigmas is not None:
                raise UsageError("spike_sigmas needs the lookback ring: leave ring at its default or set it above 0")
            return None
        if sigmas is not None and steps < window + 8:
            raise UsageError(f"spike_window={window} needs ring of at least {window + 8} steps, got ring={steps}")
        params = [self._names[id(p)] for p in self._params]
        lb = Lookback(steps, self.recipe.modules, params, self.hooks.fmt, horizon=horizon, spike_sigmas=sigmas,
                      spike_window=window, quiet=self.quiet, speaks=self.rank in (None, 0), device=self.device.type)
        if self.engine not in SHARDED:  # a sharded optimizer state holds this rank's pieces: no per-layer update figures
            self.recipe.ring_figures = RingFigures(self.optimizer, self._params,
                                                   every=1 if sigmas is not None else OPTIMIZER_EVERY)
        return lb

    def forecast(self) -> list[Any]:
        """The layers the ring says are on course to leave the format's range within ``forecast_horizon``
        steps, soonest first, as of now (``judge.history.Forecast``); [] without a ring."""
        return self.lookback.forecast() if self.lookback is not None else []

    # while the kernel builds ---------------------------------------------------------------------
    def _warm_start(self) -> bool:
        """Full mode on the CPU while the statistics kernel is being built: sentinel checks only (every step's loss
        and gradient norms), full statistics from a step that trips them, and on every step once the kernel is
        ready. The eager path would cost every step 1.7x meanwhile. ``AMPDOCTOR_WARMUP=full`` keeps full
        statistics on the eager path instead."""
        if self.mode != "full" or self.device.type != "cpu" or os.environ.get("AMPDOCTOR_WARMUP", "sentinel") == "full":
            return False
        if self.recipe.shards is not None and self.ranks is not None:
            return False  # the ranks' kernels get ready at different steps: their recorded steps (collectives) must agree

        if not fused.pending():
            return False
        self.hooks.record_if = self._warm_wants_full
        self.recipe.sentinel = self.hooks.fmt.max
        return True

    def _warm_wants_full(self, step: int) -> bool:
        if self._warming and fused.pending():
            return step < self._full_until
        self._warming = False  # the kernel is ready (or will not come): full statistics from now on
        self.hooks.record_if = None
        self.recipe.sentinel = None
        return step % self.hooks.every == 0

    # sentinel mode -----------------------------------------------------------------------------
    def _scheduled(self, step: int) -> bool:
        """Whether ``step`` is recorded in full (every rank's schedule is the same)."""
        h = self.hooks
        return h.record_if(step) if h.record_if is not None else step % h.every == 0

    def _wants_full(self, step: int) -> bool:
        """Sentinel mode: whether ``step`` gets full per-layer statistics."""
        return step % self.full_every == 0 or step < self._full_until

    def _trip_stats(self, inv_scale: float | None) -> StepStats:
        """The sentinel tripped on a step not recorded: take what is still there in full now, the
        parameter gradients (and weights with ``weights=True``). A second host copy, on this step only.
        ``inv_scale``: the gradients still carry the loss scale (see ``Hooks.after_backward``)."""
        h = self.hooks
        h.begin_step(self.step_num, record=True)
        h.after_backward(inv_scale)
        h.after_step()
        sh, rx = self.recipe.shards, self.ranks
        if sh is None or rx is None:
            st = h.end_step()
        else:  # every rank trips at the same step (``_measure``): the pieces' rows are reduced across them
            ns, nm = sh.sizes(True)
            nrow = len(sh.counts)

            def reduce(keys: list[Any], rows: torch.Tensor) -> torch.Tensor:
                import torch.distributed as dist

                sums, maxes = sh.tables(keys, rows)
                dist.all_reduce(sums, group=rx.group)
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=rx.group)
                return torch.cat([sums, maxes])

            st = h.end_step(reduce)
            got = h.exchanged
            if got is not None:
                sh.apply(st, got[: ns - nrow], got[ns - nrow: ns - nrow + nm])
        st.extra["sentinel_trip"] = 1.0
        return st

    def after_step(self, skipped: bool | None = None) -> MonitorRecord:
        """Your own loop: call after the optimizer step and ``scaler.update()``. No host sync.

        ``skipped`` defaults to what the step did: with a GradScaler, its verdict (exactly what the
        scaler did: it skips on a non-finite gradient; a non-finite loss with finite gradients is
        applied, and logged ``applied:nonfinite_loss``); without one, the monitor's verdict if you read
        ``should_skip`` this step (you skipped on it), else applied: a plain loop applies every step,
        and a non-finite one is logged as ``applied:<reason>``, not as a skip that did not happen.
        Writes the log row, updates the skip rate and history; may warn or raise (see the class).
        """
        if self._off is not None:
            return self._blank()
        if skipped is None and self.scaler is None and not self._asked:
            skipped = False
        return self._guarded_after_step(skipped)

    def _guarded_after_step(self, skipped: bool | None) -> MonitorRecord:
        try:
            return self._after_step(skipped)
        except (UsageError, SkipRateError):
            raise
        except Exception as e:
            self._fail("writing the step's record", e)
            return self._blank()

    def _after_step(self, skipped: bool | None) -> MonitorRecord:
        pend = self._pending
        if pend is None:
            raise UsageError("call monitor.after_backward(loss) before monitor.after_step()")
        self._pending = None
        self._asked = False
        m = pend.m
        will = m.will_skip if m.will_skip is not None else m.skip
        sk = will if skipped is None else bool(skipped)
        reason = m.reason if sk else ""
        first = m.ranks.first if m.ranks is not None else None
        if sk and first is not None and first.rank != self.rank and first.local and not any(
                f.local for f in m.ranks.faults if f.rank == self.rank):  # type: ignore[union-attr]
            reason = f"nonfinite_from_rank:{first.rank}"  # clean here: the gradients came through DDP's all-reduce
        if not sk and m.skip:  # the step was applied with a non-finite loss or gradient: say so
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
        pre, post = (m.grad_l2_pre_clip, m.grad_l2_post_clip) if self.recipe.reduced else (math.nan, math.nan)
        rec = MonitorRecord(
            pend.step, m.lr, pre, post, m.loss, sk, reason, m.scale,
            m.scale_after_if_skipped if sk else m.scale_after_if_applied, rate,
            m.bad_params, m.bad_count, pend.injected, m.stats if self.keep_stats else None,
            m.stats is not None and "sentinel_trip" in m.stats.extra, rank=self.rank, ranks=m.ranks,
            capture_held=self.capture.held if self.capture is not None else None, step_convention=self.step_convention,
        )
        if m.ranks is not None and m.ranks.faults and self.first_fault is None:
            first = m.ranks.first
            assert first is not None
            self.first_fault = FirstFault(pend.step, first.rank, first.kind, first.module, m.ranks.others_clean,
                                          m.ranks.column(), m.ranks.spread)
        if self.writer is not None:
            self.writer.write(rec.row())
        spike = (self.lookback.push(rec.step, loss=rec.loss, grad_norm=m.grad_l2_pre_clip, scale=rec.scaler_scale,
                                    skipped=rec.skipped, lr=rec.lr, stats=m.stats) if self.lookback is not None else None)
        self.last = rec
        self.step_num += 1
        if not self._closed:
            self.hooks.begin_step(self.step_num)
        # a fault no loss scale explains: injected, or a rank's own batch, forward or loss (seen through the exchange)
        known = bool(pend.injected) or (first is not None and first.kind in ("input", "forward", "loss"))
        # the applied update's norm (none under a sharding engine, whose norms are a shard's; none when injected)
        norm = pre if not sk and self.engine is None and not pend.injected else None
        trig = self._failing.judge(skipped=rec.skipped, reason=rec.skip_reason, scale=rec.scaler_scale, alert=False,
                                   nonfinite=m.skip, step=rec.step, injected=known, norm=norm,
                                   hidden=self._hidden_overflow(m) if not sk and not pend.injected else "")
        counted = sk and self._failing.phase not in NORMAL_SKIPS
        if len(self._recent_counted) == self.window and self._recent_counted[0]:
            self._counted_skips -= 1
        self._recent_counted.append(counted)
        self._counted_skips += int(counted)
        alerting = self.alert_rate_now > self.alert_rate and self.step_num - self.first_step >= self.alert_min_steps
        if trig is None and alerting and not self._alerted:
            trig = Trigger("skip_rate_alert")
        if trig is None and spike is not None and self.first_failure is None:
            trig = Trigger(f"{spike.what}_spike", f"{spike.value:g}, {spike.z:.1f} robust sd above the median {spike.median:g}")
        failure = None
        if trig is not None and trig.reason != "skip_rate_alert" and self.first_failure is None:
            self.first_failure = (rec.step, trig.reason)
            failure = self._failure_words(rec, m, trig)
        if self.capture is not None and not self.capture.done and trig is not None:
            self._maybe_capture(rec, m, trig, announce=failure is None)
        if failure is not None:  # one message: the failure, and where its capture went (if this rank wrote it)
            cap = self.capture
            if rec.capture and cap is not None:
                failure += "\n  " + cap.replay_hint()
            self._say_failure(failure, m)
        if self.capture is not None and self.capture.done and self.tap is not None:
            self.tap.close()  # nothing more to keep
            self.tap = None
        if self.capture is not None:
            self.capture.step_starts(self.step_num)  # the RNG as the next step begins (a replay draws the run's)
        self._judge_rate(self.alert_rate_now, pend.step)
        return rec

    def _hidden_overflow(self, m: Measured) -> str:
        """An applied step whose backward recorded a non-finite gradient (at a module's output) on a model that carries
        the user's gradient hooks: the hooks, in words (they made it finite before GradScaler looked); else ''."""
        st = m.stats
        if st is None or not any(nonfinite(r) > 0 for r in st.grad.values()):
            return ""
        hooks = userhooks.found(self.model)  # (only on such a step)
        return "; ".join(h.describe() for h in hooks[:3]) + (f" (+{len(hooks) - 3})" if len(hooks) > 3 else "")

    @property
    def alert_rate_now(self) -> float:
        """The rate the skip-rate alert and ``max_skip_rate`` judge: the rolling share of the last ``window``
        steps skipped for a reason GradScaler's own working does not explain (its calibration, growth probes
        and isolated overflows are not counted; see ``engine.capture.FailingStep``)."""
        n = len(self._recent_counted)
        return self._counted_skips / n if n else 0.0

    def _failure_words(self, rec: MonitorRecord, m: Measured, trig: Trigger) -> str:
        """'ampdoctor: step 154 failed: the loss is inf; the step was skipped at scale 65536' (+ the ranks)."""
        view = m.ranks
        first = view.first if view is not None else None
        r = rec.skip_reason.removeprefix("applied:")
        module = r.split(":", 1)[1] if r.startswith("nonfinite_grad:") else None
        if trig.reason == "nonfinite_loss":
            what = f"the loss is {rec.loss:g}"
        elif trig.reason == "nonfinite_grad":
            what = ("a gradient went non-finite" + (f", first in {module}" if module else "")
                    + (f" ({rec.nonfinite_count} parameter(s))" if rec.nonfinite_count else ""))
        elif trig.reason == "nonfinite_update":
            what = ("the update was applied with a non-finite gradient norm although GradScaler found no inf/NaN "
                    "element (were overflowed values made finite, by a gradient hook's nan_to_num or a clamp?)")
        elif trig.reason == "hidden_overflow":
            what = (f"a gradient went non-finite in backward, yet GradScaler found every parameter's finite and applied "
                    f"the update: a gradient hook of the model made it finite ({trig.detail})")
        elif trig.reason == "exploding_update":
            what = f"the update exploded ({trig.detail})"
        elif trig.reason.endswith("_spike") and self.lookback is not None and self.lookback.last_spike is not None:
            words = spike_message(self.lookback.last_spike)
            done = "skipped" if rec.skipped else "applied"
            return f"{words}; the step was {done}"
        else:
            what = f"the loss scale collapsed ({trig.detail})"
        done = "skipped" if rec.skipped else "applied"
        scale = f" at scale {rec.scaler_scale:g}" if rec.scaler_scale is not None else ""
        who = ""
        if first is not None and view is not None:
            where = f" in {first.module}" if first.module else ""
            who = (f"; rank {first.rank} went first ({first.kind}{where}), "
                   + ("the other ranks went non-finite later in the forward, through a collective" if view.spread
                      else "the other ranks were clean" if view.others_clean else "other ranks saw it too"))
        return f"ampdoctor: step {rec.step} failed: {what}; the step was {done}{scale}{who}"

    def _say_failure(self, words: str, m: Measured) -> None:
        """The run's first failing step, on stderr: once, from the rank that saw it first (rank 0 when none did)."""
        first = m.ranks.first if m.ranks is not None else None
        if self.rank is not None and self.rank != (first.rank if first is not None else 0):
            return
        say(words, quiet=self.quiet)

    def _maybe_capture(self, rec: MonitorRecord, m: Measured, trig: Trigger, announce: bool) -> None:
        cap = self.capture
        assert cap is not None
        view = m.ranks
        extra: dict[str, Any] = {"scaler_phase": self._failing.phase,
                                 "step_log": str(self.log_path) if self.log_path is not None else None}
        if view is not None:
            first = view.first
            extra = {**extra, "ranks": view.column(), "first_rank": first.rank if first is not None else None,
                     "first_module": first.module if first is not None else None,
                     "others_clean": view.others_clean if first is not None else None}
            chosen = first.rank if first is not None else 0
            if self.capture_ranks == "first" and self.rank != chosen and self.recipe.shards is None:
                cap.done = True  # this failing step is captured by rank `chosen`
                return
        before = None
        if self.scaler is not None:
            before = dict(self.scaler.state_dict())
            if m.scale is not None:
                before["scale"] = m.scale
            if m.growth_tracker is not None:
                before["_growth_tracker"] = m.growth_tracker
        tables: dict[str, str] = {}
        if self.lookback is not None:
            tables[STEPS_FILE], tables[LAYERS_FILE] = self.lookback.ring.tables()
            extra["ring"] = {"steps": self.lookback.ring.capacity, "kept": min(self.lookback.ring.count, self.lookback.ring.capacity)}
            sp = self.lookback.last_spike
            if sp is not None and trig.reason.endswith("_spike"):
                extra["spike"] = {"what": sp.what, "value": sp.value, "median": sp.median, "z": sp.z, "layers": sp.layers}
        out = cap.write(trig, step=rec.step, skipped=rec.skipped, record=rec.row(), stats=self._last_stats,
                        scaler_before=before, extra=extra, announce=announce, tables=tables)
        if out is not None:
            rec.capture = str(out)

    def _judge_rate(self, rate: float, step: int) -> None:
        n = len(self._recent)
        if rate > self.alert_rate and self.step_num - self.first_step >= self.alert_min_steps:
            if not self._alerted:
                self._alerted = True
                if self.rank in (None, 0):  # every rank skips alike: one rank says it
                    reasons = Counter(r for s, r in self.skips if s > step - n)
                    top = ", ".join(f"{r} x{c}" for r, c in reasons.most_common(3))
                    more = len(reasons) - 3
                    log_hint = (f"read the step log with `ampdoctor scaler {self.log_path}`" if self.log_path is not None
                                else "Monitor(log=...) keeps a step log for `ampdoctor scaler`")
                    normal = "" if self.scaler is None else "; GradScaler's calibration and probes not counted"
                    msg = (f"ampdoctor: step {step}: {rate:.1%} of the last {n} steps were skipped (alert_rate "
                           f"{self.alert_rate:.0%}{normal}); skip reasons: {top}{f' (+{more} more)' if more > 0 else ''}; "
                           f"{log_hint}")
                    alert(msg, SkipRateWarning, quiet=self.quiet)
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
            return no_scale_history()
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
            "counted": list(self._recent_counted),
            "failing": ({"peak_applied": self._failing._peak_applied, "prev_scale": self._failing._prev_scale,
                         "last_isolated": self._failing._last_isolated} if hasattr(self, "_failing") else None),
            "first_failure": list(self.first_failure) if self.first_failure is not None else None,
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
        # (a state saved before these fields: every recent skip counts, the scale history starts afresh)
        self._recent_counted = deque((bool(x) for x in state.get("counted", state["recent"])), maxlen=self.window)
        self._counted_skips = sum(self._recent_counted)
        f = state.get("failing")
        if isinstance(f, dict) and hasattr(self, "_failing"):
            self._failing._peak_applied = float(f.get("peak_applied") or 0.0)
            self._failing._prev_scale = None if f.get("prev_scale") is None else float(f["prev_scale"])
            self._failing._last_isolated = None if f.get("last_isolated") is None else int(f["last_isolated"])
        ff = state.get("first_failure")
        self.first_failure = (int(ff[0]), str(ff[1])) if ff else None
        self._over = int(state["over"])
        self._alerted = bool(state["alerted"])
        self.scale_changes = [(int(s), float(v)) for s, v in state["scale_changes"]]
        self.skips = [(int(s), str(r)) for s, r in state["skips"]]
        if self._off is None:
            self.hooks.begin_step(self.step_num)


__all__ = ["CAPTURE_COLUMNS", "EXTRA_COLUMNS", "RANK_COLUMNS", "STEP_COLUMNS", "STEP_CONVENTIONS", "FirstFault", "Monitor", "MonitorRecord", "SkipRateError", "SkipRateWarning"]
