"""An exploding update: an applied step whose gradient norm is ``EXPLODE_RATIO`` times the typical one (the
median of the recent applied norms, at least ``EXPLODE_HISTORY`` of them, at most ``EXPLODE_WINDOW``).
``explodes`` judges one norm, ``first_explosion`` finds the first in a run's norms."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ampdoctor.judge.thresholds import OUTLIER_RATIO

EXPLODE_RATIO = OUTLIER_RATIO
"""An applied update whose gradient norm is this many times the typical one has exploded (three orders of
magnitude, the data scan's outlier ratio): the median of the run's recent applied norms in the Monitor, FP32's
norm of the same step from the same weights in triage."""


EXPLODE_HISTORY = 8
"""Applied norms the Monitor needs before it judges an explosion (fewer: no typical norm to compare with)."""


EXPLODE_WINDOW = 64
"""The Monitor's typical applied norm is the median of at most this many of the last applied (finite) norms."""


def explodes(norm: float, history: Sequence[float]) -> bool:
    """The Monitor's exploding update: an applied gradient norm ``EXPLODE_RATIO`` times the median of the last applied
    finite norms (``history``, oldest first; only its last ``EXPLODE_WINDOW`` count), judged once ``EXPLODE_HISTORY``
    of them are there."""
    recent = list(history)[-EXPLODE_WINDOW:]
    if len(recent) < EXPLODE_HISTORY or not math.isfinite(norm):
        return False
    typical = float(statistics.median(recent))  # (the mean of the middle two of an even count)
    return typical > 0 and norm >= EXPLODE_RATIO * typical


@dataclass(frozen=True)
class Explosion:
    """The first applied step whose gradient norm exploded by the Monitor's definition (``explodes``)."""

    step: int
    norm: float
    typical: float
    """The median of the applied norms it was compared with."""
    history: int
    """How many applied norms that median was over."""


def first_explosion(steps: Sequence[tuple[int, float, bool]]) -> Explosion | None:
    """``steps``: (step, gradient norm before clipping, skipped) in order. The first applied step that explodes by the
    Monitor's definition over the applied steps before it (a skipped step and a non-finite norm join no history)."""
    history: list[float] = []
    for step, norm, skipped in steps:
        if skipped:
            continue
        if explodes(norm, history):
            recent = history[-EXPLODE_WINDOW:]
            return Explosion(step, norm, float(statistics.median(recent)), len(recent))
        if math.isfinite(norm):
            history.append(norm)
    return None
