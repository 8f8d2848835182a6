"""A few of the Monitor's figures for the user's tracker (TensorBoard, W&B, MLflow...), under an ``ampdoctor/`` prefix.

Numbers only (every tracker takes them; a string is dropped or refused), read from what the Monitor already
keeps, no extra host copy:

- ``ampdoctor/headroom_min``: the smallest headroom of any layer's output, log2(format max / largest |x|), in
  binades, at the latest recorded step; the same value as ``ampdoctor/headroom/<layer>``, so the tag names the
  layer (a new tag when another layer becomes the tightest);
- ``ampdoctor/scale``: GradScaler's scale after the step (none without one);
- ``ampdoctor/skips``: steps skipped since the figures were last taken, and ``ampdoctor/skips/<reason>`` for
  each skip reason among them (``nonfinite_loss``, ``nonfinite_grad``...); ``ampdoctor/skip_rate``: the
  rolling rate;
- ``ampdoctor/steps_to_overflow``: the forecast's steps until the soonest layer passes the format's max
  (``judge.history.Forecast.expected_step``), when a layer is on course to.

Off (no ``on_record``, no framework asking): nothing here runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ampdoctor.engine.ring import FORECAST_EVERY
from ampdoctor.notify import say
from ampdoctor.records import StepRecord
from ampdoctor.report.saving import on_record_failed

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor

PREFIX = "ampdoctor/"


def _reason(r: str) -> str:
    """A skip reason without its module (``nonfinite_grad:fc1`` is ``nonfinite_grad``): a tag per reason."""
    return r.split(":", 1)[0] or "skipped"


class Figures:
    """The figures of one Monitor; ``take()`` returns them and starts the next interval's skip count."""

    def __init__(self, mon: Monitor) -> None:
        self.mon = mon
        self._skips_seen = 0
        self._forecast: tuple[int, int | None] | None = None
        """(step it was judged at, expected step) of the last forecast taken."""

    def _headroom(self) -> dict[str, float]:
        lb = self.mon.lookback
        if lb is None:
            return {}
        _, h = lb.ring.layer_series("headroom", FORECAST_EVERY)
        for row in h[::-1]:  # the latest recorded step with any figure
            ok = np.isfinite(row)
            if ok.any():
                i = int(np.nanargmin(np.where(ok, row, np.nan)))
                v = float(row[i])
                return {PREFIX + "headroom_min": v, f"{PREFIX}headroom/{lb.ring.names[i]}": v}
        return {}

    def _steps_to_overflow(self, step: int) -> dict[str, float]:
        lb = self.mon.lookback
        if lb is None or lb.horizon is None:
            return {}
        if self._forecast is None or step - self._forecast[0] >= FORECAST_EVERY:  # judged at most every 16 steps
            fcs = lb.forecast()
            self._forecast = (step, fcs[0].expected_step if fcs else None)
        expected = self._forecast[1]
        return {} if expected is None else {PREFIX + "steps_to_overflow": float(max(expected - step, 0))}

    def take(self, rec: StepRecord | None = None) -> dict[str, float]:
        """The figures now (after the step ``rec``, else the Monitor's last)."""
        mon = self.mon
        rec = rec if rec is not None else mon.last
        if mon.off is not None or rec is None:
            return {}
        out: dict[str, float] = {}
        out.update(self._headroom())
        if rec.scale_after is not None or rec.scaler_scale is not None:
            out[PREFIX + "scale"] = float(rec.scale_after if rec.scale_after is not None else rec.scaler_scale)  # type: ignore[arg-type]
        skips = mon.history.skips
        new = skips[self._skips_seen:] if len(skips) >= self._skips_seen else []
        self._skips_seen = len(skips)
        out[PREFIX + "skips"] = float(len(new))
        for _, reason in new:
            key = f"{PREFIX}skips/{_reason(reason)}"
            out[key] = out.get(key, 0.0) + 1.0
        out[PREFIX + "skip_rate"] = float(rec.skip_rate)
        out.update(self._steps_to_overflow(rec.step))
        return {k: v for k, v in out.items() if math.isfinite(v) or k == PREFIX + "headroom_min"}


def deliver(mon: Monitor, rec: StepRecord) -> None:
    """``Monitor(on_record=fn)``: ``fn(step, figures)`` after every step. A failure of the user's function turns
    the figures off with one warning (the step, the log and the monitor go on)."""
    fn = mon.config.on_record
    if fn is None or mon._on_record_failed:
        return
    figs: Any = mon.figures.take(rec)
    try:
        fn(rec.step, figs)
    except Exception as e:
        mon._on_record_failed = True
        say(on_record_failed(e), quiet=mon.quiet)


__all__ = ["PREFIX", "Figures", "deliver"]
