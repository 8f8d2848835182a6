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

The step ``Monitor.step`` runs, in PyTorch's AMP order:
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

The monitor is this package's core (this module: the ``Monitor`` class and its public methods) and one
module per job: ``config`` (``MonitorConfig``: the keyword arguments, validated), ``records`` (the step's
record, its log columns, the warnings and errors), ``alerts`` (the skip rate, the first failure), ``injection``,
``sentinel`` (sentinel mode, the warm-up), ``capturing`` (the calls into ``engine.capture``), ``exchange`` (the
distributed first fault), ``lookback`` (the ring) and ``history`` (skips, scales, ``state_dict``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ampdoctor.engine import capture_ref
from ampdoctor.engine.capture import DEFAULT_MAX_BYTES, Capture, FailingStep, Trigger, sharded_engine
from ampdoctor.engine.driver import Driver, blank_record, skip_reason, step_record
from ampdoctor.engine.monitor import alerts, capturing, exchange, figures, history, lookback, saving, skips
from ampdoctor.engine.monitor.alerts import Rates
from ampdoctor.engine.monitor.config import MonitorConfig, steps
from ampdoctor.engine.monitor.history import History
from ampdoctor.engine.monitor.injection import Injection
from ampdoctor.engine.monitor.records import (
    CAPTURE_COLUMNS,
    EXTRA_COLUMNS,
    RANK_COLUMNS,
    SHARDED,
    STATE_VERSION,
    STEP_COLUMNS,
    STEP_CONVENTIONS,
    UNSUPPORTED,
    FirstFault,
    MonitorOffWarning,
    MonitorRecord,
    SkipRateError,
    SkipRateWarning,
    _Pending,
    _Unreadable,
)
from ampdoctor.engine.monitor.sentinel import Sentinel
from ampdoctor.engine.ranks import RankExchange, rank_path
from ampdoctor.engine.ring import SPIKE_WINDOW, Lookback
from ampdoctor.engine.shards import Shards
from ampdoctor.engine.step import Measured, Precision, TrainStep
from ampdoctor.errors import AmpDoctorError, UsageError
from ampdoctor.formats import BF16, FP16
from ampdoctor.input.batches import Micro, as_micro
from ampdoctor.judge.history import DEFAULT_HORIZON
from ampdoctor.judge.scaler import SkipLedger
from ampdoctor.notify import alert, say
from ampdoctor.records import StepStats
from ampdoctor.report import alerts as words
from ampdoctor.report.scaler import ScaleDiagnosis
from ampdoctor.watch import userhooks
from ampdoctor.watch.fused import start_build
from ampdoctor.watch.hooks import Hooks, unwrap
from ampdoctor.watch.ring import DEFAULT_STEPS
from ampdoctor.watch.steplog import Mode, StepLogWriter
from ampdoctor.watch.tap import ForwardTap

log = logging.getLogger("ampdoctor")  # heard on stderr until the application configures logging (ampdoctor.notify)


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
            out GradScaler's normal skips (calibration, growth probes, back-offs the scale explains; see
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
        on_record: a function called after every step with ``(step, figures)``: a few figures for your tracker
            under an ``ampdoctor/`` prefix (``engine.monitor.figures``; ``integrations.tensorboard.scalars(writer)``
            writes them to TensorBoard). None (default): no figures are made.
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
        on_record: Any = None,
    ) -> None:
        _check_types(model, optimizer, scaler)
        cfg = MonitorConfig(
            log=log, log_mode=log_mode, max_norm=max_norm, window=window, alert_rate=alert_rate,
            alert_min_steps=alert_min_steps, max_skip_rate=max_skip_rate, patience=patience, every=every,
            activations=activations, weights=weights, amp_dtype=amp_dtype, inject_inf_at=steps(inject_inf_at),
            inject_param=inject_param, inject_spike_at=steps(inject_spike_at), spike_factor=spike_factor,
            keep_stats=keep_stats, fsync=fsync, capture=capture, snapshot_every=snapshot_every,
            capture_max_bytes=capture_max_bytes, mode=mode, full_every=full_every, full_after=full_after,
            first_step=first_step, distributed=distributed, process_group=process_group, capture_ranks=capture_ranks,
            capture_on=capture_on, capture_hold_bytes=capture_hold_bytes, quiet=quiet, step_convention=step_convention,
            ring=ring, forecast_horizon=forecast_horizon, spike_sigmas=spike_sigmas, spike_window=spike_window,
            on_record=on_record)
        self._start(model, optimizer, scaler, cfg)
        if self.engine in UNSUPPORTED:
            if max_norm is not None:
                raise UsageError(f"max_norm: under {UNSUPPORTED[self.engine]} clip with the engine's own clip_grad_norm_")
            self._turn_off(words.Off("unsupported", UNSUPPORTED[self.engine]), warn=True, who=0)
            return
        try:
            self._build(scaler)
        except _Unreadable as e:  # a layout the monitor cannot read: off with one warning (rank 0), training goes on
            self.close()  # (every rank finds the same layout: none of them joins an exchange)
            self._turn_off(words.Off("unreadable", str(e)), warn=True, who=0)
        except AmpDoctorError:  # misuse, a log that must not be overwritten: the user's to fix, at once
            self.close()
            raise
        except Exception as e:  # something of ampdoctor's: off, with one warning; the training is not stopped
            self.close()
            self._fail("setting up the monitor", e)  # (an exchange already agreed on is joined once, flagged off)

    def _start(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scaler: torch.amp.GradScaler | None,
               cfg: MonitorConfig) -> None:
        """The state every monitor has, on or off (before anything is attached to the model)."""
        self.config = cfg
        """The settings (the keyword arguments, validated)."""
        self.quiet = cfg.quiet
        self._off: str | None = None
        """Why the monitor is off (it failed, or cannot read this setup); None while it watches."""
        self._owe_exchange = False
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.max_norm = cfg.max_norm
        self.step_num = self.first_step = cfg.first_step
        self.step_convention = cfg.step_convention
        self.window = cfg.window
        self.alert_rate = cfg.alert_rate
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
        self._backwards = 0
        self.loss_note = ""
        """A framework's words for a non-finite loss ("the Trainer's own log hides it"), said in the failure's message."""
        self._loss_seen = False
        self._loss_recipe: dict[str, Any] | None = None
        """How the loop computed its loss from the model's output (``capturing.seen_loss``), for the capture."""
        """``backward`` calls this step: a plain list of as many batches given to the step is its micro-batches."""
        self.ranks: RankExchange | None = None
        self.rank: int | None = None
        self.capture: Capture | None = None
        self.tap: ForwardTap | None = None
        self.writer: StepLogWriter | None = None
        self.lookback: Lookback | None = None
        """The lookback ring, its forecast and its spike trigger (None with ``ring=0``)."""
        self.log_path: Path | None = None
        """The step log this process writes (per rank under torch.distributed)."""
        self.rates = Rates(cfg)
        """The rolling skip rates, the alert and ``max_skip_rate`` (``alerts.Rates``)."""
        self.history = History()
        """Every skip and every change of scale (``history.History``)."""
        self.engine = sharded_engine(unwrap(model))
        """The sharding engine holding the model (``engine.capture.sharded_engine``), None for a whole model."""
        self.figures, self.saves, self._on_record_failed = figures.Figures(self), saving.Saves(), False
        """The tracker figures (``figures``), the save-time check's record (``saving``)."""

    def _build(self, scaler: torch.amp.GradScaler | None) -> None:
        """Everything built once the setup is known to be one the monitor can watch."""
        cfg = self.config
        self.keep_stats = cfg.keep_stats
        self.capture_ranks = cfg.capture_ranks
        self._batch_checked = False
        self._last_stats: StepStats | None = None
        self._asked = False
        """``should_skip`` was read this step (a loop without a GradScaler skipping on it)."""
        first = next(iter(self.model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.amp_dtype = cfg.amp_dtype if cfg.amp_dtype is not None or self.scaler is None else torch.float16
        self.injection = Injection(cfg, self.model)
        self._build_recipe()
        self.ranks = self.recipe.ranks = exchange.detect(self, cfg)
        self.rank = self.ranks.rank if self.ranks is not None else None
        if self.engine in SHARDED:
            self._build_shards()
        log_file = rank_path(str(cfg.log), self.rank) if self.rank is not None and cfg.log else cfg.log
        folder = cfg.capture
        if self.rank is not None and folder is not None:
            folder = rank_path(str(folder), self.rank)
        if folder is not None:
            self.capture = capturing.arm(self, cfg, folder)
        self._failing = FailingStep(self.scaler.get_growth_interval() if self.scaler is not None else 2000,
                                    every_skip=cfg.capture_on == "skip")
        self._episodes = skips.Episodes()
        self._build_log(log_file)
        if self.engine in SHARDED and self.rank in (None, 0):
            self._say_sharded(scaler)
        self.lookback = lookback.build(self, cfg)
        self.hooks.on_error = self._hook_failed
        self.hooks.attach()
        self.hooks.begin_step(self.step_num)
        start_build()  # the one-pass statistics kernel, built by another process if not cached (watch.fused)
        self.sentinel.warm_start(self.device, self.recipe.shards is not None and self.ranks is not None)

    def _build_recipe(self) -> None:
        """The hooks, the step recipe (the same one ``ampdoctor triage`` runs) and the sentinel's schedule."""
        cfg, amp = self.config, self.amp_dtype
        self.hooks = Hooks(self.model, BF16 if amp == torch.bfloat16 else FP16, activations=cfg.activations,
                           params=cfg.weights, every=cfg.every)
        self.recipe = TrainStep(self.model, self.optimizer, self.scaler, hooks=self.hooks, max_norm=cfg.max_norm,
                                precision=Precision.for_autocast(amp, self.scaler is not None),
                                sentinel=self.hooks.fmt.max if cfg.mode == "sentinel" else None)
        """The step recipe the monitor runs (the same one ``ampdoctor triage`` runs)."""
        self.driver = Driver(self.recipe)
        """The loop's parts around the recipe, the same the triage stages, ``layers`` and the replay run."""
        self._params = self.recipe.params
        self._names = self.recipe.names
        self.sentinel = Sentinel(cfg, self.hooks, self.recipe)

    def _build_shards(self) -> None:
        """A sharding engine's pieces (``engine.shards``): norms and rows reduced across the ranks."""
        assert self.engine is not None
        rx = self.ranks
        rank, world = (rx.rank, rx.world) if rx is not None else exchange.dist_rank()
        self.recipe.shards = sh = Shards(self.engine, self.model, self._params, rank, world)
        if rx is not None:
            rx.by_position = self.engine == "tensor_parallel"  # ranks share a batch: order by the forward
            rx.derived_inputs = self.engine in ("fsdp1", "fsdp2")  # (their mixed precision casts the batch)
        if sh.problem is not None:
            raise _Unreadable(f"{SHARDED[self.engine]} over {sh.problem} is not supported yet")

    def _build_log(self, log_file: str | Path | None) -> None:
        """The step-log writer; a wrong log path fails now, not after the first step (rows already there: judged at
        the first write, as a load_state_dict may yet continue the run)."""
        cfg = self.config
        self.log_path = Path(log_file) if log_file else None
        if not log_file:
            return
        extra = (EXTRA_COLUMNS + (CAPTURE_COLUMNS if self.capture is not None else ())
                 + (RANK_COLUMNS if self.rank is not None else ()) + (STEP_COLUMNS if cfg.step_convention is not None else ()))
        fresh = cfg.fresh_step
        self.writer = StepLogWriter(log_file, extra_columns=extra, mode=cfg.log_mode, fsync=cfg.fsync, fresh_step=fresh)
        self.writer.check(cfg.first_step if cfg.first_step > fresh else None)

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
        return self.rates.rate

    @property
    def alert_rate_now(self) -> float:
        """The rate the skip-rate alert and ``max_skip_rate`` judge: the rolling share of the last ``window``
        steps skipped, GradScaler's calibration not counted (its back-offs are: skips that waste a share of the
        steps are a failure however the scale explains them; see ``engine.capture.FailingStep``)."""
        return self.rates.counted_rate

    @property
    def total_skips(self) -> int:
        """Skipped steps since the first."""
        return self.history.total_skips

    @property
    def skips(self) -> list[tuple[int, str]]:
        """(step, reason) of every skipped step."""
        return self.history.skips

    @property
    def scale_changes(self) -> list[tuple[int, float]]:
        """(first step, scale) each time the scale used changed: the whole scale history, compactly."""
        return self.history.scale_changes

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
            say(words.sharded_no_exchange(name), quiet=self.quiet)
        if (self.engine == "fsdp1" and self.scaler is not None and type(scaler).__name__ != "ShardedGradScaler"
                and self.recipe.ranks is not None):  # (DTensor gradients: GradScaler's found-inf is all-reduced already)
            alert(words.sharded_plain_scaler(name), RuntimeWarning, quiet=self.quiet)

    # failing safe ------------------------------------------------------------------------------
    def _turn_off(self, why: words.Off, *, warn: bool, who: int | None = None) -> None:
        """Turn the monitor off for the rest of the run: hooks, tap and the exchange go; the log is closed.
        ``warn``: say it (once, on this rank; ``who``: only on that rank)."""
        if self._off is not None:
            return
        self._off = words.off_reason(why)
        self._pending = None
        for part in ("tap", "hooks", "writer"):
            obj = getattr(self, part, None)
            if obj is not None:
                try:
                    obj.close() if part != "hooks" else obj.detach()
                except Exception:
                    pass
        rank = self.rank
        if rank is None and who is not None:  # (before the exchange exists: the process group's rank)
            rank = exchange.process_rank()
        if warn and (who is None or rank is None or who == rank):
            msg = words.monitor_off(self._off, rank if who is None else None)  # (who: said for every rank)
            alert(msg, MonitorOffWarning, quiet=self.quiet)

    def _fail(self, where: str, exc: BaseException) -> None:
        """Something of ampdoctor's raised: off, with one warning naming the step and what failed. Under
        torch.distributed the other ranks learn it at the next exchange (this rank still joins it once)."""
        if self._off is not None:
            return
        if self.ranks is not None:
            self._owe_exchange = True
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        self._turn_off(words.Off("failed", where, self.step_num, error=type(exc).__name__, detail=detail), warn=True)

    def _forward_starts(self) -> None:
        if self.capture is not None and self._pending is None:
            self.capture.step_starts(self.step_num, forward=True)

    def _hook_failed(self, exc: BaseException) -> None:
        self._fail("recording the forward", exc)

    def _pay_exchange(self) -> None:
        exchange.pay(self)

    def _blank(self) -> MonitorRecord:
        """The record of a step taken while the monitor is off (no measurement)."""
        rec = blank_record(self.step_num, self.rank)
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
        if self._off is None:
            return self.injection.spike(target, self.step_num)
        return target

    @property
    def inject_inf_at(self) -> set[int]:
        """The steps at which an Inf is written into a gradient (settable while the run goes)."""
        return self.injection.inf_at

    @inject_inf_at.setter
    def inject_inf_at(self, v: int | Iterable[int] | None) -> None:
        self.injection.inf_at = set(steps(v))

    @property
    def inject_param(self) -> str | None:
        """The parameter an Inf is written into (None: the first with a gradient)."""
        return self.injection.param

    @inject_param.setter
    def inject_param(self, name: str | None) -> None:
        self.injection.param = name

    def _inject_inf(self) -> str:
        return self.injection.inf(self.step_num, self._params, self._names)

    # the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, batch: Any = None) -> None:
        """Gradient accumulation: the (scaled) backward of one micro-batch's loss, already divided by
        the number of micro-batches as loops do. After the last one call ``step()`` with no loss: the
        step's logged loss is the sum over its micro-batches (the full loss, not the last one's share).

        ``batch``: this micro-batch (in the form your spec's dataloader yields), kept for the capture;
        the step's micro-batches are kept together and replay as one accumulated step."""
        _check_loss(loss, "backward")
        capturing.seen_loss(self, loss)
        self._keep_micro(batch)
        if self._off is None:
            try:
                self.recipe.note_loss(loss)
            except Exception as e:
                self._fail("the loss check", e)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self._accumulated = True
        self._backwards += 1

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
            capturing.seen_loss(self, loss)
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
        self.driver.apply(pend.m)  # step or skip, scaler.update() on both paths
        self.recipe.zero_grad()
        return self._guarded_after_step(None)

    def note_loss(self, loss: torch.Tensor, batch: Any = None) -> None:
        """A micro-batch's loss, for loops (and framework callbacks) that run backward themselves and
        call ``after_backward()`` with no loss: the step's logged loss is the sum of the noted ones,
        and a non-finite one is logged (``nonfinite_loss``). No host sync. ``batch``: that micro-batch,
        kept for the capture (see ``backward``)."""
        _check_loss(loss, "note_loss")
        capturing.seen_loss(self, loss)
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
            capturing.seen_loss(self, loss)
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
        calls, self._backwards = self._backwards, 0
        if micro and batch is not None:
            raise UsageError("the step's micro-batches were given to backward()/note_loss(); give the step no batch= "
                             "(or pass ampdoctor.MicroBatches([...]) to it and none to backward)")
        if micro:
            return Micro(micro) if len(micro) > 1 else micro[0]
        return as_micro(batch, calls)  # a plain list of the step's micro-batches (issue 45)

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
        m, injected = self.driver.measure(loss, self._inject_inf, observe=observe)
        if m.ranks is not None and m.ranks.off:  # a rank's monitor failed: every rank turns off, here and now
            self.ranks = self.recipe.ranks = None
            self._turn_off(words.Off("rank_failed", step=self.step_num, rank=m.ranks.off[0]), warn=True, who=0)
            return None
        injected = self.injection.label(injected)
        self.sentinel.trip(m, self.step_num, self.ranks)
        if not observe:
            m.will_skip = m.skip
        self._pending = _Pending(self.step_num, m, injected)
        if m.stats is not None:
            self._last_stats = m.stats
        capturing.keep_batch(self, batch)
        return self._pending

    def forecast(self) -> list[Any]:
        """The layers the ring says are on course to leave the format's range within ``forecast_horizon``
        steps, soonest first, as of now (``judge.history.Forecast``); [] without a ring."""
        return self.lookback.forecast() if self.lookback is not None else []

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
        rec = self._record(pend, skipped)
        m = pend.m
        if self.first_fault is None:
            self.first_fault = exchange.first_fault(m, pend.step)
        if self.writer is not None:
            self.writer.write(rec.row())
        spike = lookback.push(self.lookback, rec, m)
        self.last = rec
        self.step_num += 1
        if not self._closed:
            self.hooks.begin_step(self.step_num)
        self._judge_failure(rec, pend, spike)
        capturing.step_done(self)
        self.saves.note(rec)
        figures.deliver(self, rec)
        self.rates.judge(pend.step, self.step_num - self.first_step, self.skips, speaks=self.rank in (None, 0),
                         quiet=self.quiet, log_path=str(self.log_path) if self.log_path is not None else None,
                         scaler=self.scaler is not None)
        return rec

    def _record(self, pend: _Pending, skipped: bool | None) -> MonitorRecord:
        """The step's record: the skip as it happened and its reason; the rolling rate and the history counted."""
        m = pend.m
        will = m.will_skip if m.will_skip is not None else m.skip
        sk = will if skipped is None else bool(skipped)
        reason = skip_reason(m, sk, self.rank)
        rate = self.rates.push(sk)
        self.history.add(pend.step, sk, reason, m.scale)
        pre, post = (m.grad_l2_pre_clip, m.grad_l2_post_clip) if self.recipe.reduced else (math.nan, math.nan)
        return step_record(pend.step, m, skipped=sk, reason=reason, rank=self.rank, grad_l2_pre_clip=pre,
                           grad_l2_post_clip=post, skip_rate=rate, injected=pend.injected,
                           stats=m.stats if self.keep_stats else None,
                           tripped=m.stats is not None and "sentinel_trip" in m.stats.extra,
                           capture_held=self.capture.held if self.capture is not None else None,
                           step_convention=self.step_convention)

    def _judge_failure(self, rec: MonitorRecord, pend: _Pending, spike: Any) -> None:
        """Whether the step failed (``engine.capture.FailingStep``: a skip judged by what the gradients did): the run's
        first failure is said once, with the folder its capture went to; the capture is written at the first trigger
        (a provisional one leaves it armed); a later run of skips judged a failure is said once (``skips``)."""
        m = pend.m
        sk = rec.skipped
        # a fault no loss scale explains: injected, or a rank's own batch, forward or loss (seen through the exchange)
        first = m.ranks.first if m.ranks is not None else None
        known = bool(pend.injected) or (first is not None and first.kind in ("input", "forward", "loss"))
        # the applied update's norm (none under a sharding engine, whose norms are a shard's; none when injected)
        norm = rec.grad_l2_pre_clip if not sk and self.engine is None and not pend.injected else None
        fs = self._failing
        trig = fs.judge(skipped=sk, reason=rec.skip_reason, scale=rec.scaler_scale, alert=False, nonfinite=m.skip,
                        step=rec.step, injected=known, norm=norm, grad_max=skips.grad_figure(m, sk),
                        hidden=self._hidden_overflow(m) if not sk and not pend.injected else "")
        if sk and fs.run_first == rec.step and self.capture is not None:
            self.capture.skip_run_starts(rec.step, skips.scaler_before(self, m))
        self.rates.push_counted(sk and fs.phase != "calibration")
        if trig is None and self.rates.alerting(self.step_num - self.first_step) and not self.rates.alerted:
            trig = Trigger("skip_rate_alert")
        if trig is None and spike is not None and self.first_failure is None:
            trig = Trigger(f"{spike.what}_spike", f"{spike.value:g}, {spike.z:.1f} robust sd above the median {spike.median:g}")
        self._episodes.later(self, rec, trig)
        failure = None
        if trig is not None and trig.reason != "skip_rate_alert" and self.first_failure is None:
            self.first_failure = (trig.first if trig.first is not None else rec.step, trig.reason)
            self._episodes.first_failure(rec.step, fs.run_first if sk else None, rec.scaler_scale)
            last = self.lookback.last_spike if self.lookback is not None else None
            failure = words.failure_message(alerts.failure_fact(rec, m, trig, last, fs.run_scale))
        if self.capture is not None and not self.capture.done and trig is not None:
            capturing.write(self, rec, m, trig, announce=failure is None)
            held = self.capture.holds_failure() if rec.capture else ""
            if held:
                say(f"ampdoctor: {held}", quiet=self.quiet)
        if failure is not None:  # one message: the failure, and where its capture went (if this rank wrote it)
            if self.loss_note and isinstance(rec.loss, float) and not math.isfinite(rec.loss):
                failure += f"; {self.loss_note}"
            if rec.capture and self.capture is not None:
                failure += "\n  " + self.capture.replay_hint()
            alerts.say_failure(failure, m, self.rank, self.quiet)

    def _hidden_overflow(self, m: Measured) -> str:
        """An applied step whose backward recorded a non-finite gradient (at a module's output) on a model that carries
        the user's gradient hooks: the hooks, in words (they made it finite before GradScaler looked); else ''."""
        st = m.stats
        if st is None or not st.any_nonfinite("grad"):
            return ""
        hooks = userhooks.found(self.model)  # (only on such a step)
        return "; ".join(h.describe() for h in hooks[:3]) + (f" (+{len(hooks) - 3})" if len(hooks) > 3 else "")

    def saving(self, path: str | Path | None = None) -> str | None:
        """Call when your loop is about to save a checkpoint (``path``: where, for the message). Says once, on the
        terminal, that the state being saved holds NaN/Inf or follows a step that applied a non-finite update, and
        which step; returns that message (None: the state is sound). Observes only: the save goes on unchanged."""
        try:
            return saving.check(self, path)
        except Exception as e:
            self._fail("checking the state at a save", e)
            return None

    def saved(self, path: str | Path) -> None:
        """Call after your loop saved a checkpoint at ``path`` (a Trainer ``checkpoint-N`` folder, a Lightning ``.ckpt``,
        a ``torch.save`` of the state dicts): the capture then starts from it by reference, holding the batches since
        instead of a copy of the model (``engine.capture_ref``). Observes only."""
        try:
            capture_ref.saved(self.capture, path, self.step_num)
        except Exception as e:
            self._fail("noting a saved checkpoint", e)

    # history -----------------------------------------------------------------------------------
    def scale_history(self) -> tuple[list[int], list[float], list[bool]]:
        """(steps, scales used, skipped) for every step since the first, rebuilt from the compact history."""
        return self.history.scales(self.first_step, self.step_num)

    def diagnose(self) -> ScaleDiagnosis:
        """Scale-history diagnosis of the run so far (needs a GradScaler)."""
        return self.history.diagnose(self.first_step, self.step_num, self.scaler)

    def ledger(self) -> SkipLedger:
        """Which steps were skipped, why, and the runs of consecutive skips."""
        return self.history.ledger(self.first_step, self.step_num, self.scaler is not None)

    def state_dict(self) -> dict[str, Any]:
        """Counters and history, to save next to ``scaler.state_dict()`` in a checkpoint."""
        return history.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters and history; the next step continues the step numbers (and the log)."""
        history.load_state_dict(self, state)


__all__ = ["CAPTURE_COLUMNS", "EXTRA_COLUMNS", "RANK_COLUMNS", "STATE_VERSION", "STEP_COLUMNS", "STEP_CONVENTIONS",
           "FirstFault", "Monitor", "MonitorConfig", "MonitorOffWarning", "MonitorRecord", "SkipRateError",
           "SkipRateWarning"]
