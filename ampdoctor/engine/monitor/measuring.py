"""A Monitor's measurement at the step's one host copy (``after_backward``'s inside): the step's batch for the
capture, the statistics, the sentinel's trip and the pending step; a failure turns the monitor off, and under
torch.distributed this rank still joins the step's exchange."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ampdoctor.engine.monitor import capturing, exchange, failsafe
from ampdoctor.engine.monitor.records import SkipRateError, _Pending
from ampdoctor.errors import UsageError
from ampdoctor.input.batches import Micro, as_micro
from ampdoctor.report import alerts as words

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor


def step_batch(mon: Monitor, batch: Any) -> Any:
    """The step's batch for the capture: the one given, or the micro-batches given to ``backward`` /
    ``note_loss`` (kept together: ``MicroBatches``)."""
    micro, mon._micro = mon._micro, []
    calls, mon._backwards = mon._backwards, 0
    if micro and batch is not None:
        raise UsageError("the step's micro-batches were given to backward()/note_loss(); give the step no batch= "
                         "(or pass ampdoctor.MicroBatches([...]) to it and none to backward)")
    if micro:
        return Micro(micro) if len(micro) > 1 else micro[0]
    return as_micro(batch, calls)  # a plain list of the step's micro-batches (issue 45)


def after_backward(mon: Monitor, loss: torch.Tensor | None, batch: Any, observe: bool) -> _Pending | None:
    """The measurement at the step's one host copy; None when it failed (the monitor is then off, and
    under torch.distributed this rank has joined the step's exchange all the same)."""
    if mon._pending is not None:
        raise UsageError("after_backward called twice for one step; call after_step() in between")
    rx = mon.ranks
    calls = rx.calls if rx is not None else 0
    try:
        return _measure(mon, loss, batch, observe)
    except (UsageError, SkipRateError):
        raise
    except Exception as e:
        failsafe.fail(mon, "measuring the step", e)
        if rx is not None and rx.calls == calls:  # this step's exchange is still to be joined
            exchange.pay(mon)
        return None


def _measure(mon: Monitor, loss: torch.Tensor | None, batch: Any, observe: bool) -> _Pending | None:
    m, injected = mon.driver.measure(loss, mon._inject_inf, observe=observe)
    if m.ranks is not None and m.ranks.off:  # a rank's monitor failed: every rank turns off, here and now
        mon.ranks = mon.recipe.ranks = None
        failsafe.turn_off(mon, words.Off("rank_failed", step=mon.step_num, rank=m.ranks.off[0]), warn=True, who=0)
        return None
    injected = mon.injection.label(injected)
    mon.sentinel.trip(m, mon.step_num, mon.ranks)
    if not observe:
        m.will_skip = m.skip
    mon._pending = _Pending(mon.step_num, m, injected)
    if m.stats is not None:
        mon._last_stats = m.stats
    capturing.keep_batch(mon, batch)
    return mon._pending
