"""What GradScaler forensics finds, as data: the thresholds a scale is judged by (``SATURATION``, ``CEILING``,
``COLLAPSE_BINADES``, GradScaler's defaults), the classes of a scale history (``Pattern``, one dataclass per
``ScaleFinding`` with the figures its words need), the recommendations (``Advice``) and ``ScaleFacts``, the whole
answer. The meaning of each pattern: ``judge.scaler``'s docstring; the words: ``report.words.scaler``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

SATURATION = 2.0**16
"""Scales at or above 2^16 (up to about 2^24) mean the gradients are small and far from FP16's max."""


CEILING = 2.0**24
"""About where a scale that keeps growing ends up: FP16 gradients of 2^-24 (its smallest subnormal) reach 1."""


COLLAPSE_BINADES = 8
"""A fall of this many binades from the first scale, ending at the minimum with most steps skipped, is a collapse."""


DEFAULT_GROWTH_INTERVAL = 2000


DEFAULT_BACKOFF = 0.5


Pattern = Literal["calibrating", "stable", "climbing", "saturated", "oscillating", "collapsed", "never_growing", "empty"]
"""The class of a scale history (see the module's docstring)."""


@dataclass(frozen=True)
class Empty:
    """No steps were recorded (``no_scaler``: there is no GradScaler whose history could be read)."""

    no_scaler: bool = False


@dataclass(frozen=True)
class Collapsed:
    first: float
    low: float
    binades: float
    """log2(first / low): how far the scale fell (inf when it reached 0 or below)."""
    applied: bool
    """Some step was applied."""
    tail_rate: float
    """Skip rate over the last ``tail_steps`` steps."""
    tail_steps: int


@dataclass(frozen=True)
class NeverGrowing:
    clean_run: int
    """The longest run of clean steps."""
    growth_interval: int
    given: bool
    """``growth_interval`` was the scaler's own setting (else inferred or PyTorch's default)."""


@dataclass(frozen=True)
class Oscillating:
    skips: int
    """Skips after calibration."""
    cycles: int
    """Growths between the first and the last of them."""
    gap: int
    """The median clean steps between them."""


@dataclass(frozen=True)
class Saturated:
    scale: float
    """The final scale (2^16 or above)."""
    ceiling: bool
    """It reached ``CEILING``: even FP16's smallest subnormal gradient times it reaches 1."""


@dataclass(frozen=True)
class Climbing:
    growths: int
    low: float
    """The lowest scale before the first growth."""
    high: float
    """The scale the last growth reached."""
    growth_interval: int


@dataclass(frozen=True)
class Calibrating:
    skips: int
    init: float
    settled: float


@dataclass(frozen=True)
class Stable:
    scale: float
    """The last scale used."""
    low: float
    high: float
    isolated: int
    """Skips after calibration."""


@dataclass(frozen=True)
class Unmoved:
    """The scale never moved, no skip, in fewer clean steps than ``growth_interval``: no evidence either way."""

    scale: float
    steps: int
    growth_interval: int
    assumed: bool
    """``growth_interval`` is PyTorch's default: neither given nor seen in the history."""


ScaleFinding = Empty | Collapsed | NeverGrowing | Oscillating | Saturated | Climbing | Calibrating | Stable | Unmoved
"""What the history shows, with the figures its explanation needs (``report.words.scaler.explain``)."""


AdviceCode = Literal[
    "use_bf16", "keep_layer_fp32", "backoff_bad_batches", "backoff_near_ceiling", "call_update_every_step",
    "growth_interval_recurring", "init_scale_held", "init_scale_plateau", "growth_interval_bounced",
    "init_scale_reached", "growth_interval_faster", "init_scale_calibration", "check_isolated_skips",
]
"""One recommendation: its setting (``init_scale``, ``growth_interval``, ``backoff_factor`` or none) and its reason."""


@dataclass(frozen=True)
class Advice:
    """A recommendation as data (``report.words.scaler.advise`` writes it)."""

    code: AdviceCode
    value: float = math.nan
    """The recommended value of the code's setting (nan for advice without one)."""
    current: float = math.nan
    """``backoff_*``: the back-off factor the run used."""
    count: int = 0
    """What the reason counts: consecutive skips (``backoff_*``), clean steps between skips (``growth_interval_recurring``),
    overflows (``init_scale_held``), bounces, steps, growths or calibration skips."""
    step: int = 0
    """``init_scale_plateau``: the step where the run reached the plateau."""
    steps: tuple[int, ...] = ()
    """``check_isolated_skips``: the first ten isolated skips."""
    batches: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """``check_isolated_skips`` of a cycled dataloader: (batch, the steps that replayed it) for each batch with isolated
    skips, in the order of its first skip: one batch seen several times is said once."""


@dataclass
class ScaleFacts:
    """The diagnosis of a scale history as codes and figures; ``ampdoctor.report.scaler`` words it."""

    pattern: Pattern
    finding: ScaleFinding
    calibration_skips: int
    """Skips that took the scale to a new low on its way down from init_scale."""
    later_skips: list[int]
    """Skipped steps that were not calibration skips."""
    growths: list[int]
    """Steps whose scale is larger than the step before's (the growth happened in the step before's update)."""
    backoffs: list[int]
    advice: list[Advice] = field(default_factory=list)
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


def empty(no_scaler: bool = False) -> ScaleFacts:
    """The diagnosis of no history (``no_scaler``: the run has no GradScaler)."""
    return ScaleFacts("empty", Empty(no_scaler), 0, [], [], [])
