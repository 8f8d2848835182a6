"""The skips judged by what the gradients did (``capture.trigger.FailingStep``): the figure it reads from each applied
step, the first skip of a run of skips, and the report of skipping that goes on after the run's first failure.

An applied step's largest *unscaled* gradient is worked out only when a skip needs it (from that step's recorded
rows, kept by reference: no figure is made on a step nobody asks about). After the first failure has been said, a
later run of skips that the judgement calls a failure is said once (how many steps, how far the scale fell), without
waiting for ``alert_min_steps``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ampdoctor.notify import say
from ampdoctor.records import Col, StepStats
from ampdoctor.report import alerts as words

if TYPE_CHECKING:
    from ampdoctor.capture.trigger import Trigger
    from ampdoctor.engine.monitor import Monitor
    from ampdoctor.engine.monitor.records import MonitorRecord
    from ampdoctor.engine.step import Measured


def largest_gradient(st: StepStats, scale: float | None) -> float | None:
    """The largest finite unscaled gradient magnitude of a recorded step: parameter gradients' rows (unscaled) and
    the gradients at module outputs (as the backward computed them: times ``scale``). None when none is recorded."""
    s = scale if scale is not None and math.isfinite(scale) and scale > 0 else 1.0
    pend = st.row_matrix
    if pend is not None:
        keys, rows = pend
        if not len(rows):
            return None
        kinds = np.fromiter((k[0] for k in keys), dtype=object, count=len(keys))
        div = np.where(kinds == "grad", s, np.where(kinds == "pgrad", 1.0, np.nan))
        vals = rows[:, Col.ABSMAX] / div
    else:
        vals = np.array([float(r[Col.ABSMAX]) / s for r in st.grad.values()]
                        + [float(r[Col.ABSMAX]) for r in st.pgrad.values()])
    vals = vals[np.isfinite(vals)]
    return float(vals.max()) if len(vals) else None


def grad_figure(m: Measured, skipped: bool) -> Callable[[], float | None] | float | None:
    """What ``FailingStep.judge`` reads of an applied step: its largest unscaled gradient, worked out on demand from
    its rows; without rows, its gradient norm (an upper bound of every parameter gradient's largest element)."""
    if skipped:
        return None
    st, scale = m.stats, m.scale
    if st is not None:
        return lambda: largest_gradient(st, scale)
    norm = m.grad_l2_pre_clip
    return norm if norm is not None and math.isfinite(norm) and norm > 0 else None


def scaler_before(mon: Monitor, m: Measured) -> dict[str, Any] | None:
    """GradScaler's state as the step began, from the figures the step's one host copy brought (no sync)."""
    sc = mon.scaler
    if sc is None or m.scale is None:
        return None
    return {"scale": m.scale, "growth_factor": sc.get_growth_factor(), "backoff_factor": sc.get_backoff_factor(),
            "growth_interval": sc.get_growth_interval(), "_growth_tracker": m.growth_tracker or 0}


class Episodes:
    """The runs of skips after the run's first failure: the 1st, 2nd, 4th, 8th... run judged a failure is said
    once each, from the 2nd on with the tally since the first failure (a run that keeps failing every few steps
    is told in a handful of lines, not one a run)."""

    def __init__(self) -> None:
        self.said: int | None = None
        """The first step of the last run of skips judged (the first failure's, or a later one's)."""
        self.at: int | None = None
        """The first failure's step."""
        self.scale: float | None = None
        """GradScaler's scale at the first failure."""
        self.runs = 0
        """Runs of failing skips judged since the first failure."""
        self.skipped = 0
        """Steps skipped since the first failure (any reason)."""

    def first_failure(self, step: int, run_first: int | None, scale: float | None = None) -> None:
        self.said = run_first if run_first is not None else step
        self.at, self.scale = step, scale

    def later(self, mon: Monitor, rec: MonitorRecord, trig: Trigger | None) -> None:
        """A skip judged a failure after the first failure: its run counted once, and said at the 1st, 2nd, 4th...
        run (from the rank that speaks)."""
        if mon.first_failure is None:
            return
        if rec.skipped and self.at is not None and rec.step > self.at:
            self.skipped += 1
        f = mon._failing
        first = f.run_first
        if trig is None or not rec.skipped or first is None or first == self.said:
            return
        self.said = first
        self.runs += 1
        if mon.rank not in (None, 0) or self.runs & (self.runs - 1):
            return
        s0, s = f.run_scale, rec.scaler_scale
        after = s * mon.scaler.get_backoff_factor() if s is not None and mon.scaler is not None else s
        since = (self.at, self.runs, self.skipped, self.scale) if self.runs > 1 and self.at is not None else None
        fact = words.SkipRun(first, rec.step, rec.step - first + 1, s0, after, trig.reason, trig.why, trig.need, since)
        say(words.skip_run_message(fact), quiet=mon.quiet)


__all__ = ["Episodes", "grad_figure", "largest_gradient", "scaler_before"]
