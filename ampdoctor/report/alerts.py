"""Facts from inside a training run, turned into the messages the engine passes to ``ampdoctor.notify``.

The engine (the Monitor, its lookback ring) knows what happened: a failing step, a skip rate, a spike, a
forecast, a ring's story. It builds one of the small facts below (or hands over a ``judge.history`` one) and
calls the function here that words it; the sentences themselves live in ``report.words``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ampdoctor.judge.history import Forecast, Spike
from ampdoctor.judge.rules_target import forward_overflow_fixes
from ampdoctor.report.words import deepspeed as ds_words
from ampdoctor.report.words import monitor as words
from ampdoctor.report.words.lookback import forecast_message, history_lines, history_title, spike_message
from ampdoctor.report.words.monitor import (
    capture_without_batch,
    first_fault,
    monitor_off,
    rank_alone,
    sharded_no_exchange,
    sharded_plain_scaler,
    skip_rate_error,
)


@dataclass(frozen=True)
class FirstRank:
    """The rank that went non-finite first at a step (``parallel.exchange.RankView.first``), and what the others did."""

    rank: int
    kind: str
    """input | forward | loss | backward | grad (``parallel.exchange.KINDS``)."""
    module: str | None
    others_clean: bool
    spread: bool = False
    together: tuple[tuple[int, str, str | None], ...] = ()
    """Every rank that saw it in its own batch, forward, loss or activation gradients (several: none went first)."""


@dataclass(frozen=True)
class Failure:
    """The run's first failing step: what failed (the trigger), where, and the step's numbers."""

    step: int
    scale: float | None
    """The scale the step used (None without a GradScaler)."""
    reason: str
    """The trigger (``capture.trigger.Trigger.reason``): nonfinite_loss, nonfinite_grad, ..., ``<what>_spike``."""
    detail: str
    """The trigger's figures, as it gives them."""
    skipped: bool
    """The step was skipped (else applied)."""
    loss: float
    """The step's loss (the sum over its micro-batches)."""
    module: str | None = None
    """The module whose gradient went non-finite first (nonfinite_grad)."""
    bad_count: int = 0
    """How many parameters had a non-finite gradient."""
    first: FirstRank | None = None
    """Under torch.distributed: the rank that went first."""
    spike: Spike | None = None
    """With the spike trigger: the spike this step was (its layers named)."""
    run_first: int | None = None
    """A failure judged at a skip after other skips: the first of them (the failure is said at that step)."""
    run_scale: float | None = None
    """The scale ``run_first`` used."""
    why: str = ""
    """``capture.trigger.Trigger.why``: unscaled | jump ('' for the other triggers)."""
    need: float | None = None


@dataclass(frozen=True)
class SkipRun:
    """A run of skips judged a failure after the run's first failure was said (``engine.monitor.skips``)."""

    first: int
    step: int
    count: int
    scale0: float | None
    scale: float | None
    reason: str
    why: str
    need: float | None
    since: tuple[int, int, int, float | None] | None = None
    """From the second run said on: (the first failure's step, the runs of failing skips judged since, the steps
    skipped since, the scale at the first failure)."""


@dataclass(frozen=True)
class SkipRate:
    """The rolling skip rate went above ``alert_rate``: the figures of the alert."""

    step: int
    rate: float
    window: int
    """Steps the rate is over."""
    alert_rate: float
    reasons: tuple[tuple[str, int], ...]
    """The skip reasons in the window, most common first, with their counts."""
    log_path: str | None
    scaler: bool
    """A GradScaler's normal skips were left out of the rate."""


@dataclass(frozen=True)
class Off:
    """Why the monitor turned itself off (``Monitor.off`` keeps the words)."""

    code: str
    """unsupported (a sharding engine it cannot read), zero_stage (a DeepSpeed ZeRO stage it cannot read), unreadable (a sharded layout it cannot reduce), failed (its
    own code raised), rank_failed (another rank's monitor failed)."""
    what: str = ""
    """unsupported: the engine's name; unreadable: the layout's problem; failed: what failed (the step's part)."""
    step: int = 0
    rank: int | None = None
    """rank_failed: the rank whose monitor failed."""
    error: str = ""
    """failed: the exception's type."""
    detail: str = ""
    """failed: the first line of its message."""
    stage: int = 0
    """zero_stage: DeepSpeed's ZeRO stage."""


def off_reason(o: Off) -> str:
    """The reason ``Monitor.off`` gives, and the warning's middle."""
    if o.code == "unsupported":
        return words.unsupported_engine(o.what)
    if o.code == "zero_stage":
        return ds_words.zero_stage(o.stage)
    if o.code == "unreadable":
        return words.unreadable_layout(o.what)
    if o.code == "rank_failed":
        return words.rank_failed(o.rank if o.rank is not None else -1, o.step)
    return words.failed_at(o.what, o.step, o.error, o.detail)


def failure_message(f: Failure) -> str:
    """'ampdoctor: step 154 failed: the loss is inf; the step was skipped at scale 65536' (+ the rank that went first)."""
    if f.reason.endswith("_spike") and f.spike is not None:
        return words.spike_failure(spike_message(f.spike), f.skipped)
    what = words.failure_what(f.reason, f.detail, f.loss, f.module, f.bad_count)
    step, scale = (f.run_first, f.run_scale) if f.run_first is not None else (f.step, f.scale)
    what += words.skip_why(f.why, step, f.step, f.scale, f.need)
    first = (f.first.rank, f.first.kind, f.first.module) if f.first is not None else None
    return words.failure(step, what, f.skipped, scale, first, f.first.spread if f.first else False,
                         f.first.others_clean if f.first else False, list(f.first.together) if f.first else None)


def skip_run_message(r: SkipRun) -> str:
    """'ampdoctor: steps 50-60 skipped (11 in a row); scale 32768 -> 16, 11 binade(s) down' and why, on a second line."""
    why = words.skip_cause(r.why, r.need) or words.skip_run_reason(r.reason)
    return words.skip_run(r.first, r.step, r.count, r.scale0, r.scale, why, r.since)


def skip_rate_message(s: SkipRate) -> str:
    """The skip-rate alert (``SkipRateWarning``): the rate, its top three reasons, where to read the log."""
    return words.skip_rate_alert(s.step, s.rate, s.window, s.alert_rate, list(s.reasons[:3]), len(s.reasons) - 3,
                                 s.log_path, s.scaler)


def forecast_alert(forecasts: list[Forecast], device: str) -> str:
    """The forecast warning (``ForecastWarning``) for the soonest of ``forecasts``, with triage's fixes for a forward
    overflow of its layer."""
    fc = forecasts[0]
    return forecast_message(fc, forward_overflow_fixes(fc.layer, device), more=len(forecasts) - 1)


def deepspeed_replay_hint(where: object, spec: str) -> str:
    """Where a DeepSpeed rank's capture went and how to replay every rank's pieces (``DeepSpeedMonitor.replay_hint``)."""
    return ds_words.replay_hint(where, spec)


def deepspeed_no_backward() -> str:
    """The warning for a DeepSpeed step that came without ``engine.backward(loss)``."""
    return ds_words.NO_BACKWARD


def history_words(told: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The ring's story before a failure (``judge.history.story``): the finding's title and its lines."""
    return history_title(told), history_lines(told)


__all__ = ["Failure", "FirstRank", "Off", "SkipRate", "SkipRun", "skip_run_message", "capture_without_batch", "deepspeed_no_backward",
           "deepspeed_replay_hint", "failure_message", "first_fault",
           "forecast_alert", "history_words", "monitor_off", "off_reason", "rank_alone", "sharded_no_exchange", "sharded_plain_scaler",
           "skip_rate_error", "skip_rate_message"]
