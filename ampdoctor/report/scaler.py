"""GradScaler forensics in words: the judge's ``ScaleFacts`` with their explanation and recommendations written.

``diagnose_scale`` (the public ``ampdoctor.diagnose_scale``) and ``Monitor.diagnose`` return a ``ScaleDiagnosis``:
the facts' figures as they are, plus ``explanation`` and ``recommendations`` from ``report.words.scaler``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ampdoctor.judge import scaler as judge
from ampdoctor.report.words import scaler as words


@dataclass
class ScaleDiagnosis:
    pattern: str
    """calibrating | stable | climbing | saturated | oscillating | collapsed | never_growing | empty"""
    explanation: str
    calibration_skips: int
    """Skips that took the scale to a new low on its way down from init_scale."""
    later_skips: list[int]
    """Skipped steps that were not calibration skips."""
    growths: list[int]
    """Steps whose scale is larger than the step before's (the growth happened in the step before's update)."""
    backoffs: list[int]
    recommendations: list[str] = field(default_factory=list)
    settings: dict[str, float] = field(default_factory=dict)
    """Recommended ``init_scale``, ``growth_interval``, ``backoff_factor`` (only those worth changing)."""
    growth_interval: int | None = None
    """Given, or inferred from the clean steps before each growth (None when neither)."""
    backoff_factor: float | None = None
    """Given, or inferred from the scale ratio at each skip."""
    min_scale: float = math.nan
    """The smallest scale of the history, ``final_scale`` included (so it is never above it)."""
    max_scale: float = math.nan
    final_scale: float = math.nan
    """The scale after the last step's update, where the history shows it (else the last scale used)."""


def worded(d: judge.ScaleFacts) -> ScaleDiagnosis:
    """The facts with their words."""
    return ScaleDiagnosis(d.pattern, words.explain(d.finding), d.calibration_skips, d.later_skips, d.growths, d.backoffs,
                          words.recommendations(d), d.settings, d.growth_interval, d.backoff_factor, d.min_scale,
                          d.max_scale, d.final_scale)


def diagnose_scale(
    scales: Sequence[float],
    skipped: Sequence[bool],
    *,
    growth_interval: int | None = None,
    backoff_factor: float | None = None,
    init_scale: float | None = None,
    steps: Sequence[int] | None = None,
) -> ScaleDiagnosis:
    """Classify the history of a GradScaler (one scale used and one skip flag per step), in words.

    ``growth_interval`` and ``backoff_factor`` are the scaler's settings when known; otherwise
    they are inferred from the history (2000 and 0.5, PyTorch's defaults, when it shows none).
    ``steps`` names the rows (default 0..n-1); every step list in the result uses those names.
    The figures are ``ampdoctor.judge.scaler.diagnose_scale``'s.
    """
    return worded(judge.diagnose_scale(scales, skipped, growth_interval=growth_interval, backoff_factor=backoff_factor,
                                       init_scale=init_scale, steps=steps))


def no_scale_history() -> ScaleDiagnosis:
    """The diagnosis of a run without a GradScaler."""
    return worded(judge.empty(no_scaler=True))
