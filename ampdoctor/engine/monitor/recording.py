"""A Monitor's step once the optimizer has stepped (``after_step``'s inside): the step's record and its reason, the
log row, the lookback ring, whether the step failed (``failure``), the capture, the figures, the skip rates."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ampdoctor.engine.driver import skip_reason, step_record
from ampdoctor.engine.monitor import capturing, exchange, failsafe, failure, figures, fp8, lookback
from ampdoctor.engine.monitor.records import MonitorRecord, SkipRateError, _Pending
from ampdoctor.errors import UsageError

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor


def after_step(mon: Monitor, skipped: bool | None) -> MonitorRecord:
    try:
        return _after_step(mon, skipped)
    except (UsageError, SkipRateError):
        raise
    except Exception as e:
        failsafe.fail(mon, "writing the step's record", e)
        return failsafe.blank(mon)


def _after_step(mon: Monitor, skipped: bool | None) -> MonitorRecord:
    pend = mon._pending
    if pend is None:
        raise UsageError("call monitor.after_backward(loss) before monitor.after_step()")
    mon._pending = None
    mon._asked = False
    rec = record(mon, pend, skipped)
    m = pend.m
    if mon.first_fault is None:
        mon.first_fault = exchange.first_fault(m, pend.step)
    if mon.writer is not None:
        mon.writer.write(rec.row())
    spike = lookback.push(mon.lookback, rec, m)
    fp8.step_done(mon, pend.step)
    mon.last = rec
    mon.step_num += 1
    if not mon._closed:
        mon.hooks.begin_step(mon.step_num)
    failure.judge(mon, rec, pend, spike)
    capturing.step_done(mon)
    mon.saves.note(rec)
    figures.deliver(mon, rec)
    mon.rates.judge(pend.step, mon.step_num - mon.first_step, mon.skips, speaks=mon.rank in (None, 0),
                    quiet=mon.quiet, log_path=str(mon.log_path) if mon.log_path is not None else None,
                    scaler=mon.scaler is not None)
    return rec


def record(mon: Monitor, pend: _Pending, skipped: bool | None) -> MonitorRecord:
    """The step's record: the skip as it happened and its reason; the rolling rate and the history counted."""
    m = pend.m
    will = m.will_skip if m.will_skip is not None else m.skip
    sk = will if skipped is None else bool(skipped)
    reason = skip_reason(m, sk, mon.rank)
    rate = mon.rates.push(sk)
    mon.history.add(pend.step, sk, reason, m.scale)
    pre, post = (m.grad_l2_pre_clip, m.grad_l2_post_clip) if mon.recipe.reduced else (math.nan, math.nan)
    return step_record(pend.step, m, skipped=sk, reason=reason, rank=mon.rank, grad_l2_pre_clip=pre,
                       grad_l2_post_clip=post, skip_rate=rate, injected=pend.injected,
                       stats=m.stats if mon.keep_stats else None,
                       tripped=m.stats is not None and "sentinel_trip" in m.stats.extra,
                       capture_held=mon.capture.held if mon.capture is not None else None,
                       step_convention=mon.step_convention)
