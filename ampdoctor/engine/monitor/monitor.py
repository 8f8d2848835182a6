"""The ``Monitor`` class: its keyword arguments (its API, validated into a ``MonitorConfig``), its public methods and
the step's order. Each job it hands to a part of this package: ``building`` (what it builds once the setup is known),
``measuring`` (the step's one host copy), ``recording`` (the step's record, log row and ring), ``failure`` (whether a
step failed: said once, captured), ``failsafe`` (turning off, the plain step once off), and the parts the package's
docstring lists."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ampdoctor.capture import reference as capture_ref
from ampdoctor.capture.trigger import FailingStep
from ampdoctor.capture.write import DEFAULT_MAX_BYTES, Capture
from ampdoctor.engine.driver import Driver
from ampdoctor.engine.fp8_watch import Fp8Watch
from ampdoctor.engine.monitor import (
    building,
    capturing,
    exchange,
    failsafe,
    figures,
    history,
    measuring,
    recording,
    saving,
    skips,
)
from ampdoctor.engine.monitor.alerts import Rates
from ampdoctor.engine.monitor.config import MonitorConfig, check_loss, check_types, steps
from ampdoctor.engine.monitor.history import History
from ampdoctor.engine.monitor.injection import Injection
from ampdoctor.engine.monitor.records import UNSUPPORTED, FirstFault, MonitorRecord, _Pending, _Unreadable
from ampdoctor.engine.monitor.sentinel import Sentinel
from ampdoctor.engine.ring import SPIKE_WINDOW, Lookback
from ampdoctor.engine.step import TrainStep
from ampdoctor.errors import AmpDoctorError, UsageError
from ampdoctor.judge.history import DEFAULT_HORIZON
from ampdoctor.judge.scaler import SkipLedger
from ampdoctor.parallel.exchange import RankExchange
from ampdoctor.parallel.registry import sharded_engine
from ampdoctor.records import StepStats
from ampdoctor.report import alerts as words
from ampdoctor.report.scaler import ScaleDiagnosis
from ampdoctor.watch.hooks import Hooks
from ampdoctor.watch.model_view import unwrap
from ampdoctor.watch.ring import DEFAULT_STEPS
from ampdoctor.watch.steplog import Mode, StepLogWriter
from ampdoctor.watch.tap import ForwardTap

log = logging.getLogger("ampdoctor")  # heard on stderr until the application configures logging (ampdoctor.notify)


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
            ``capture.trigger.FailingStep``); ``"skip"``: every skip of non-finite gradients is a failure.
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
        watch_ops: the forecast also reads the largest value of each op inside a module (``q @ k^T`` growing in an
            attention whose output stays small; ``watch.opwatch``): off by default, it cost 1.47x a step on a model of
            386 small modules (0.98x on a GPT-style one); gradients and the loss are read either way.
        spike_sigmas: a loss or gradient norm more than this many robust standard deviations above the median
            of the ``spike_window`` applied steps before it is a failure: said, captured, and the layers whose
            update norms spiked first named. None (default): off. See docs/long-runs.md.
        spike_window: see ``spike_sigmas``.
        on_record: a function called after every step with ``(step, figures)``: a few figures for your tracker
            under an ``ampdoctor/`` prefix (``engine.monitor.figures``; ``integrations.tensorboard.scalars(writer)``
            writes them to TensorBoard). None (default): no figures are made.
    """

    # what ``building.build`` makes once the setup is one the monitor can watch (absent while it is off from the start)
    hooks: Hooks
    recipe: TrainStep
    """The step recipe the monitor runs (the same one ``ampdoctor triage`` runs)."""
    driver: Driver
    """The loop's parts around the recipe, the same the triage stages, ``layers`` and the replay run."""
    sentinel: Sentinel
    injection: Injection
    device: torch.device
    amp_dtype: torch.dtype | None
    keep_stats: bool
    capture_ranks: Literal["first", "all"]
    _params: list[nn.Parameter]
    _names: dict[int, str]
    _failing: FailingStep
    _episodes: skips.Episodes
    _batch_checked: bool
    _last_stats: StepStats | None
    _asked: bool
    """``should_skip`` was read this step (a loop without a GradScaler skipping on it)."""

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
        watch_ops: bool = False,
        spike_sigmas: float | None = None,
        spike_window: int = SPIKE_WINDOW,
        on_record: Any = None,
    ) -> None:
        check_types(model, optimizer, scaler)
        cfg = MonitorConfig(
            log=log, log_mode=log_mode, max_norm=max_norm, window=window, alert_rate=alert_rate,
            alert_min_steps=alert_min_steps, max_skip_rate=max_skip_rate, patience=patience, every=every,
            activations=activations, weights=weights, amp_dtype=amp_dtype, inject_inf_at=steps(inject_inf_at),
            inject_param=inject_param, inject_spike_at=steps(inject_spike_at), spike_factor=spike_factor,
            keep_stats=keep_stats, fsync=fsync, capture=capture, snapshot_every=snapshot_every,
            capture_max_bytes=capture_max_bytes, mode=mode, full_every=full_every, full_after=full_after,
            first_step=first_step, distributed=distributed, process_group=process_group, capture_ranks=capture_ranks,
            capture_on=capture_on, capture_hold_bytes=capture_hold_bytes, quiet=quiet, step_convention=step_convention,
            ring=ring, forecast_horizon=forecast_horizon, watch_ops=watch_ops, spike_sigmas=spike_sigmas, spike_window=spike_window,
            on_record=on_record)
        self._start(model, optimizer, scaler, cfg)
        if self.engine in UNSUPPORTED:
            if max_norm is not None:
                raise UsageError(f"max_norm: under {UNSUPPORTED[self.engine]} clip with the engine's own clip_grad_norm_")
            failsafe.turn_off(self, words.Off("unsupported", UNSUPPORTED[self.engine]), warn=True, who=0)
            return
        try:
            building.build(self, scaler)
        except _Unreadable as e:  # a layout the monitor cannot read: off with one warning (rank 0), training goes on
            self.close()  # (every rank finds the same layout: none of them joins an exchange)
            failsafe.turn_off(self, words.Off("unreadable", str(e)), warn=True, who=0)
        except AmpDoctorError:  # misuse, a log that must not be overwritten: the user's to fix, at once
            self.close()
            raise
        except Exception as e:  # something of ampdoctor's: off, with one warning; the training is not stopped
            self.close()
            failsafe.fail(self, "setting up the monitor", e)  # (an exchange already agreed on is joined once, flagged off)

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
        """(step, reason) of the run's first failing step (see ``capture.trigger.FailingStep``)."""
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
        self.fp8: Fp8Watch | None = None
        """A torchao-converted model's per-GEMM FP8 statistics (``engine.monitor.fp8``); None for any other model."""
        self.log_path: Path | None = None
        """The step log this process writes (per rank under torch.distributed)."""
        self.rates = Rates(cfg)
        """The rolling skip rates, the alert and ``max_skip_rate`` (``alerts.Rates``)."""
        self.history = History()
        """Every skip and every change of scale (``history.History``)."""
        self.engine = sharded_engine(unwrap(model))
        """The sharding engine holding the model (``parallel.registry.sharded_engine``), None for a whole model."""
        self.figures, self.saves, self._on_record_failed = figures.Figures(self), saving.Saves(), False
        """The tracker figures (``figures``), the save-time check's record (``saving``)."""

    # lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks and close the log. Safe to call twice; never raises."""
        self._closed = True
        for part in ("tap", "hooks", "writer", "fp8"):
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
        steps are a failure however the scale explains them; see ``capture.trigger.FailingStep``)."""
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

    # failing safe ------------------------------------------------------------------------------
    def _fail(self, where: str, exc: BaseException) -> None:  # (the framework integrations fail safe through these)
        failsafe.fail(self, where, exc)

    def _turn_off(self, why: words.Off, *, warn: bool, who: int | None = None) -> None:
        failsafe.turn_off(self, why, warn=warn, who=who)

    def _hook_failed(self, exc: BaseException) -> None:
        failsafe.fail(self, "recording the forward", exc)

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
        check_loss(loss, "backward")
        capturing.seen_loss(self, loss)
        self._keep_micro(batch)
        if self._off is None:
            try:
                self.recipe.note_loss(loss)
            except Exception as e:
                failsafe.fail(self, "the loss check", e)
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
            check_loss(loss, "step")
            capturing.seen_loss(self, loss)
        elif not self._accumulated:
            raise UsageError("step() without a loss: call monitor.backward(loss) for each micro-batch first")
        self._accumulated = False
        batch = measuring.step_batch(self, batch)
        if self._off is not None:
            return failsafe.plain_step(self, loss)
        if loss is not None:
            try:
                self.recipe.note_loss(loss)  # the loss check, on the device
            except Exception as e:
                failsafe.fail(self, "the loss check", e)
                return failsafe.plain_step(self, loss)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        pend = measuring.after_backward(self, loss, batch, observe=False)
        if pend is None:  # it failed: the step goes on without the monitor
            return failsafe.plain_step(self, None)
        self.driver.apply(pend.m)  # step or skip, scaler.update() on both paths
        self.recipe.zero_grad()
        return recording.after_step(self, None)

    def note_loss(self, loss: torch.Tensor, batch: Any = None) -> None:
        """A micro-batch's loss, for loops (and framework callbacks) that run backward themselves and
        call ``after_backward()`` with no loss: the step's logged loss is the sum of the noted ones,
        and a non-finite one is logged (``nonfinite_loss``). No host sync. ``batch``: that micro-batch,
        kept for the capture (see ``backward``)."""
        check_loss(loss, "note_loss")
        capturing.seen_loss(self, loss)
        self._keep_micro(batch)
        if self._off is not None:
            return
        try:
            self.recipe.note_loss(loss)
        except Exception as e:
            failsafe.fail(self, "the loss check", e)

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
            check_loss(loss, "after_backward")
            capturing.seen_loss(self, loss)
        batch = measuring.step_batch(self, batch)
        if self._owe_exchange:
            exchange.pay(self)
        if self._off is not None:
            return
        if loss is not None:
            try:
                self.recipe.note_loss(loss)
            except Exception as e:
                failsafe.fail(self, "the loss check", e)
                exchange.pay(self)
                return
        measuring.after_backward(self, loss, batch, observe=True)

    def _keep_micro(self, batch: Any) -> None:
        if batch is not None and self.capture is not None and not self.capture.done:
            self._micro.append(batch)

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
            return failsafe.blank(self)
        if skipped is None and self.scaler is None and not self._asked:
            skipped = False
        return recording.after_step(self, skipped)

    def saved(self, path: str | Path) -> None:
        """Call after your loop saved a checkpoint at ``path``: the capture starts from it by reference (``capture.reference``)."""
        capture_ref.saved(self.capture, path, self.step_num, on_error=self._fail)

    def saving(self, path: str | Path | None = None) -> str | None:
        """Call when your loop is about to save a checkpoint (``path``: where, for the message). Says once, on the
        terminal, that the state being saved holds NaN/Inf or follows a step that applied a non-finite update, and
        which step; returns that message (None: the state is sound). Observes only: the save goes on unchanged."""
        try:
            return saving.check(self, path)
        except Exception as e:
            failsafe.fail(self, "checking the state at a save", e)
            return None

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
