"""The monitor's lookback ring (``engine.ring.Lookback``): built from the settings, fed after each step.

The ring keeps each step's scalars and the recorded steps' per-layer figures; the forecast and the spike
trigger judge them (``engine.ring``); the capture writes its tables (``capturing``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ampdoctor.engine import growth
from ampdoctor.engine.monitor.config import MonitorConfig
from ampdoctor.engine.monitor.records import SHARDED, MonitorRecord
from ampdoctor.engine.ring import OPTIMIZER_EVERY, ForecastWarning, Lookback, RingFigures
from ampdoctor.engine.step import Measured
from ampdoctor.judge.history import Spike

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor


def build(mon: Monitor, cfg: MonitorConfig) -> Lookback | None:
    """The ring of ``cfg.ring`` steps, its forecast and spike trigger (None with ``ring=0``); the recipe queues the
    per-parameter ring figures into the step's one host copy (not under a sharding engine: a sharded optimizer
    state holds this rank's pieces)."""
    if cfg.ring == 0:
        return None
    names = mon.recipe.names
    params = mon.recipe.params
    lb = Lookback(cfg.ring, mon.recipe.modules, [names[id(p)] for p in params], mon.hooks.fmt,
                  horizon=cfg.forecast_horizon, spike_sigmas=cfg.spike_sigmas, spike_window=cfg.spike_window,
                  quiet=cfg.quiet, speaks=mon.rank in (None, 0), device=mon.device.type)
    lb.growth = growth.build(mon.model, mon.hooks, mon.hooks.fmt, mon.amp_dtype or torch.float16,  # type: ignore[attr-defined]
                             horizon=cfg.forecast_horizon, quiet=cfg.quiet, speaks=mon.rank in (None, 0), device=mon.device.type,
                             category=ForecastWarning, watch_ops=cfg.watch_ops)
    if mon.engine not in SHARDED:
        mon.recipe.ring_figures = RingFigures(mon.optimizer, params,
                                              every=1 if cfg.spike_sigmas is not None else OPTIMIZER_EVERY)
    return lb


def push(lb: Lookback | None, rec: MonitorRecord, m: Measured) -> Spike | None:
    """Keep the step in the ring; a spike when the trigger is on and this step is one."""
    if lb is None:
        return None
    spike = lb.push(rec.step, loss=rec.loss, grad_norm=m.grad_l2_pre_clip, scale=rec.scaler_scale, skipped=rec.skipped,
                    lr=rec.lr, stats=m.stats)
    g = getattr(lb, "growth", None)
    if g is not None:  # the ops, gradients and loss (engine.growth)
        g.push(rec.step, m.stats, rec.loss, rec.scaler_scale, rec.skipped)
    return spike


__all__ = ["build", "push"]
