"""Whether a Monitor's step failed (``capture.trigger.FailingStep``: a skip judged by what the gradients did), and
what follows: the run's first failure said once, with the folder its capture went to; the capture written at the
first trigger; a later run of skips judged a failure said once (``skips``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ampdoctor.capture.trigger import Trigger
from ampdoctor.engine.monitor import alerts, capturing, skips
from ampdoctor.engine.monitor.records import MonitorRecord, _Pending
from ampdoctor.engine.step import Measured
from ampdoctor.notify import say
from ampdoctor.report import alerts as words
from ampdoctor.watch import userhooks

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor


def judge(mon: Monitor, rec: MonitorRecord, pend: _Pending, spike: Any) -> None:
    """Whether the step failed (``capture.trigger.FailingStep``: a skip judged by what the gradients did): the run's
    first failure is said once, with the folder its capture went to; the capture is written at the first trigger
    (a provisional one leaves it armed); a later run of skips judged a failure is said once (``skips``)."""
    m = pend.m
    sk = rec.skipped
    # a fault no loss scale explains: injected, or a rank's own batch, forward or loss (seen through the exchange)
    first = m.ranks.first if m.ranks is not None else None
    known = bool(pend.injected) or (first is not None and first.kind in ("input", "forward", "loss"))
    # the applied update's norm (none under a sharding engine, whose norms are a shard's; none when injected)
    norm = rec.grad_l2_pre_clip if not sk and mon.engine is None and not pend.injected else None
    fs = mon._failing
    trig = fs.judge(skipped=sk, reason=rec.skip_reason, scale=rec.scaler_scale, alert=False, nonfinite=m.skip,
                    step=rec.step, injected=known, norm=norm, grad_max=skips.grad_figure(m, sk),
                    hidden=hidden_overflow(mon, m) if not sk and not pend.injected else "")
    if sk and fs.run_first == rec.step and mon.capture is not None:
        mon.capture.skip_run_starts(rec.step, skips.scaler_before(mon, m))
    mon.rates.push_counted(sk and fs.phase != "calibration")
    if trig is None and mon.rates.alerting(mon.step_num - mon.first_step) and not mon.rates.alerted:
        trig = Trigger("skip_rate_alert")
    if trig is None and spike is not None and mon.first_failure is None:
        trig = Trigger(f"{spike.what}_spike", f"{spike.value:g}, {spike.z:.1f} robust sd above the median {spike.median:g}")
    mon._episodes.later(mon, rec, trig)
    failure = None
    if trig is not None and trig.reason != "skip_rate_alert" and mon.first_failure is None:
        mon.first_failure = (trig.first if trig.first is not None else rec.step, trig.reason)
        mon._episodes.first_failure(rec.step, fs.run_first if sk else None, rec.scaler_scale)
        last = mon.lookback.last_spike if mon.lookback is not None else None
        failure = words.failure_message(alerts.failure_fact(rec, m, trig, last, fs.run_scale))
    if mon.capture is not None and not mon.capture.done and trig is not None:
        capturing.write(mon, rec, m, trig, announce=failure is None)
        held = mon.capture.holds_failure() if rec.capture else ""
        if held:
            say(f"ampdoctor: {held}", quiet=mon.quiet)
    if failure is not None:  # one message: the failure, and where its capture went (if this rank wrote it)
        if mon.loss_note and isinstance(rec.loss, float) and not math.isfinite(rec.loss):
            failure += f"; {mon.loss_note}"
        if rec.capture and mon.capture is not None:
            failure += "\n  " + mon.capture.replay_hint()
        alerts.say_failure(failure, m, mon.rank, mon.quiet)


def hidden_overflow(mon: Monitor, m: Measured) -> str:
    """An applied step whose backward recorded a non-finite gradient (at a module's output) on a model that carries
    the user's gradient hooks: the hooks, in words (they made it finite before GradScaler looked); else ''."""
    st = m.stats
    if st is None or not st.any_nonfinite("grad"):
        return ""
    hooks = userhooks.found(mon.model)  # (only on such a step)
    return "; ".join(h.describe() for h in hooks[:3]) + (f" (+{len(hooks) - 3})" if len(hooks) > 3 else "")
