"""The monitor's alerts: the rolling skip rate (``SkipRateWarning``, ``SkipRateError``) and the run's first failure.

The rates are counted here; the messages are worded by ``report.alerts`` from the facts handed to it, and said
through ``ampdoctor.notify`` once, from the rank that knows.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from ampdoctor.capture.trigger import Trigger
from ampdoctor.engine.monitor.config import MonitorConfig
from ampdoctor.engine.monitor.records import MonitorRecord, SkipRateError, SkipRateWarning
from ampdoctor.engine.step import Measured
from ampdoctor.judge.history import Spike
from ampdoctor.notify import alert, say
from ampdoctor.report import alerts as words


class Rates:
    """The two rolling windows of the last ``window`` steps: every skip (``skip_rate``), and the skips that count
    for the alert and ``max_skip_rate`` (every skip but GradScaler's calibration)."""

    def __init__(self, cfg: MonitorConfig) -> None:
        self.window = cfg.window
        self.alert_rate = cfg.alert_rate
        self.alert_min_steps = cfg.alert_min_steps
        self.max_skip_rate = cfg.max_skip_rate
        self.patience = cfg.patience
        self.recent: deque[bool] = deque(maxlen=self.window)
        self.recent_skips = 0
        self.counted: deque[bool] = deque(maxlen=self.window)
        """Per step of the window: a skip that counts for the alert (not GradScaler's calibration or probe)."""
        self.counted_skips = 0
        self.over = 0
        """Consecutive steps above ``max_skip_rate``."""
        self.alerted = False

    def push(self, skipped: bool) -> float:
        """Count a step in the rolling skip rate; returns the rate, this step included."""
        if len(self.recent) == self.window and self.recent[0]:
            self.recent_skips -= 1
        self.recent.append(skipped)
        self.recent_skips += int(skipped)
        return self.rate

    def push_counted(self, counted: bool) -> None:
        if len(self.counted) == self.window and self.counted[0]:
            self.counted_skips -= 1
        self.counted.append(counted)
        self.counted_skips += int(counted)

    @property
    def rate(self) -> float:
        return self.recent_skips / len(self.recent) if self.recent else 0.0

    @property
    def counted_rate(self) -> float:
        n = len(self.counted)
        return self.counted_skips / n if n else 0.0

    def alerting(self, steps_run: int) -> bool:
        """The counted rate is above ``alert_rate``, after ``alert_min_steps`` steps."""
        return self.counted_rate > self.alert_rate and steps_run >= self.alert_min_steps

    def judge(self, step: int, steps_run: int, skips: list[tuple[int, str]], *, speaks: bool, quiet: bool,
              log_path: str | None, scaler: bool) -> None:
        """Warn once when the counted rate goes above ``alert_rate`` (re-armed when it drops); raise
        ``SkipRateError`` when it stayed above ``max_skip_rate`` for ``patience`` steps."""
        rate, n = self.counted_rate, len(self.recent)
        if self.alerting(steps_run):
            if not self.alerted:
                self.alerted = True
                if speaks:  # every rank skips alike: one rank says it
                    reasons = Counter(r for s, r in skips if s > step - n).most_common()
                    fact = words.SkipRate(step, rate, n, self.alert_rate, tuple(reasons), log_path, scaler)
                    alert(words.skip_rate_message(fact), SkipRateWarning, quiet=quiet)
        elif rate <= self.alert_rate:
            self.alerted = False
        if self.max_skip_rate is not None:
            self.over = self.over + 1 if rate > self.max_skip_rate else 0
            if self.over >= self.patience:
                raise SkipRateError(words.skip_rate_error(step, rate, n, self.max_skip_rate, self.over,
                                                          skips[-1][1] if skips else "?"))

    def load(self, state: dict[str, Any]) -> None:
        self.recent = deque((bool(x) for x in state["recent"]), maxlen=self.window)
        self.recent_skips = sum(self.recent)
        # (a state saved before this field: every recent skip counts)
        self.counted = deque((bool(x) for x in state.get("counted", state["recent"])), maxlen=self.window)
        self.counted_skips = sum(self.counted)
        self.over = int(state["over"])
        self.alerted = bool(state["alerted"])


def failure_fact(rec: MonitorRecord, m: Measured, trig: Trigger, spike: Spike | None,
                 run_scale: float | None = None) -> words.Failure:
    """The run's first failing step, as the facts ``report.alerts.failure_message`` words."""
    view = m.ranks
    first = view.first if view is not None else None
    r = rec.skip_reason.removeprefix("applied:")
    module = r.split(":", 1)[1] if r.startswith("nonfinite_grad:") else None
    together = tuple((f.rank, f.kind, f.module) for f in view.faults if f.local) if view is not None else ()
    who = (words.FirstRank(first.rank, first.kind, first.module, view.others_clean, view.spread, together)
           if first is not None and view is not None else None)
    return words.Failure(rec.step, rec.scaler_scale, trig.reason, trig.detail, rec.skipped, rec.loss, module,
                         rec.nonfinite_count, who, spike, trig.first, run_scale, trig.why, trig.need)


def say_failure(msg: str, m: Measured, rank: int | None, quiet: bool) -> None:
    """The run's first failing step, on stderr: once, from the rank that saw it first (rank 0 when none did)."""
    first = m.ranks.first if m.ranks is not None else None
    if rank is not None and rank != (first.rank if first is not None else 0):
        return
    say(msg, quiet=quiet)


__all__ = ["Rates", "failure_fact", "say_failure"]
