"""The distributed first fault: the monitor's use of ``parallel.exchange.RankExchange``.

Under torch.distributed every rank's monitor joins one small all-reduce per step, inside the step's one host
copy, that tells every rank which rank saw a non-finite value first (``FirstFault``). A rank whose monitor
turned off joins it once more, flagged off, so that no rank waits in a collective it alone would run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ampdoctor.engine.monitor.config import MonitorConfig
from ampdoctor.engine.monitor.records import FirstFault
from ampdoctor.engine.step import Measured
from ampdoctor.errors import UsageError
from ampdoctor.parallel.exchange import OFF, SLOTS, RankExchange

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor


def dist_rank() -> tuple[int, int]:
    """(rank, world size) of torch.distributed's default group, (0, 1) when it is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def process_rank() -> int | None:
    """This process's rank in torch.distributed's default group; None when it is not initialised. Never raises."""
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def detect(mon: Monitor, cfg: MonitorConfig) -> RankExchange | None:
    """The exchange of this run (None: not distributed, or ``distributed=False``)."""
    if cfg.distributed is False:
        return None
    names = mon.recipe.names
    rx = RankExchange.detect(mon.recipe.modules, [names[id(p)] for p in mon.recipe.params], cfg.process_group)
    if cfg.distributed and rx is None:
        raise UsageError("distributed=True but torch.distributed is not initialised with more than one rank")
    return rx


def pay(mon: Monitor) -> None:
    """A rank that turned off joins the exchange once more, flagged off, so that no rank waits in a
    collective it alone would run; after it every rank is off. Never raises."""
    rx = mon.ranks
    mon._owe_exchange = False
    if rx is None:
        return
    mon.ranks = None
    mon.recipe.ranks = None
    dev = mon.device
    try:
        row = torch.zeros(SLOTS, dtype=torch.float64, device=dev)
        row[0] = OFF
        sh = mon.recipe.shards
        if sh is None:
            rx.exchange(row).cpu()
        else:  # the same collectives as the others' at this step (a recorded step reduces rows too)
            ns, nm = sh.sizes(mon.sentinel.scheduled(mon.step_num))
            rx.exchange(row, torch.zeros(ns, dtype=torch.float64, device=dev),
                        torch.full((nm,), -math.inf, dtype=torch.float64, device=dev) if nm else None).cpu()
    except Exception:  # pragma: no cover - the collective itself broke: nothing more to join
        pass


def first_fault(m: Measured, step: int) -> FirstFault | None:
    """The step's first fault across the ranks, if any rank saw one."""
    view = m.ranks
    if view is None or not view.faults or view.first is None:
        return None
    f = view.first
    return FirstFault(step, f.rank, f.kind, f.module, view.others_clean, view.column(), view.spread)


__all__ = ["FirstFault", "detect", "dist_rank", "first_fault", "pay", "process_rank"]
