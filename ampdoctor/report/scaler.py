"""GradScaler forensics in words: the judge's ``ScaleFacts`` with their explanation and recommendations written.

``diagnose_scale`` (the public ``ampdoctor.diagnose_scale``) and ``Monitor.diagnose`` return a ``ScaleDiagnosis``:
the facts' figures as they are, plus ``explanation`` and ``recommendations`` from ``report.words.scaler``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ampdoctor.judge import scale_facts
from ampdoctor.judge import scaler as judge
from ampdoctor.report.words import scaler as words


@dataclass
class ScaleDiagnosis:
    """``judge.scale_facts.ScaleFacts`` in words: its figures, each as the facts define it, with the class's
    ``explanation`` and the ``recommendations`` in place of the finding and advice codes."""

    pattern: str
    explanation: str
    calibration_skips: int
    later_skips: list[int]
    growths: list[int]
    backoffs: list[int]
    recommendations: list[str] = field(default_factory=list)
    settings: dict[str, float] = field(default_factory=dict)
    growth_interval: int | None = None
    backoff_factor: float | None = None
    min_scale: float = math.nan
    max_scale: float = math.nan
    final_scale: float = math.nan


def worded(d: scale_facts.ScaleFacts) -> ScaleDiagnosis:
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
    return worded(scale_facts.empty(no_scaler=True))
