"""A Monitor that fails safe: something of ampdoctor's raised, or the setup is one it cannot read, so it turns
itself off for the rest of the run (hooks, tap and the exchange go, the log is closed, one warning) and ``step()``
runs PyTorch's AMP recipe, nothing of ampdoctor's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ampdoctor.engine.driver import blank_record
from ampdoctor.engine.monitor import exchange
from ampdoctor.engine.monitor.records import MonitorOffWarning, MonitorRecord
from ampdoctor.notify import alert
from ampdoctor.report import alerts as words

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor


def turn_off(mon: Monitor, why: words.Off, *, warn: bool, who: int | None = None) -> None:
    """Turn the monitor off for the rest of the run: hooks, tap and the exchange go; the log is closed.
    ``warn``: say it (once, on this rank; ``who``: only on that rank)."""
    if mon._off is not None:
        return
    mon._off = words.off_reason(why)
    mon._pending = None
    for part in ("tap", "hooks", "writer"):
        obj = getattr(mon, part, None)
        if obj is not None:
            try:
                obj.close() if part != "hooks" else obj.detach()
            except Exception:
                pass
    rank = mon.rank
    if rank is None and who is not None:  # (before the exchange exists: the process group's rank)
        rank = exchange.process_rank()
    if warn and (who is None or rank is None or who == rank):
        msg = words.monitor_off(mon._off, rank if who is None else None)  # (who: said for every rank)
        alert(msg, MonitorOffWarning, quiet=mon.quiet)


def fail(mon: Monitor, where: str, exc: BaseException) -> None:
    """Something of ampdoctor's raised: off, with one warning naming the step and what failed. Under
    torch.distributed the other ranks learn it at the next exchange (this rank still joins it once)."""
    if mon._off is not None:
        return
    if mon.ranks is not None:
        mon._owe_exchange = True
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    turn_off(mon, words.Off("failed", where, mon.step_num, error=type(exc).__name__, detail=detail), warn=True)


def plain_step(mon: Monitor, loss: torch.Tensor | None) -> MonitorRecord:
    """``step()`` once the monitor is off: PyTorch's AMP recipe, nothing of ampdoctor's."""
    opt, sc = mon.optimizer, mon.scaler
    assert opt is not None
    if loss is not None:
        (sc.scale(loss) if sc is not None else loss).backward()
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if sc is not None:
        if mon.max_norm is not None:
            try:
                sc.unscale_(opt)
            except RuntimeError:  # already unscaled this step (the failure came after it)
                pass
            torch.nn.utils.clip_grad_norm_(params, mon.max_norm)
        sc.step(opt)
        sc.update()
    else:
        if mon.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, mon.max_norm)
        opt.step()
    opt.zero_grad(set_to_none=True)
    return blank(mon)


def blank(mon: Monitor) -> MonitorRecord:
    """The record of a step taken while the monitor is off (no measurement)."""
    rec = blank_record(mon.step_num, mon.rank)
    mon.step_num += 1
    return rec
