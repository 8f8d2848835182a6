"""GradScaler forensics: classify a scale history, list the skips, and recommend scaler settings.

Pure functions over a run's per-step history: the scale each step *used* (``scaler.get_scale()``
before that step's ``update()``, the ``scaler_scale`` column of the step log) and its skip flag.
The scale after step ``i``'s update is the scale step ``i + 1`` used, so a skip at step ``i``
shows as ``scales[i + 1] < scales[i]`` and a growth as ``scales[i + 1] > scales[i]``.

Patterns (``ScaleFacts.pattern``), each with its meaning:

- ``collapsed``: the scale fell below 1, no step was ever applied, or it ended at its minimum
  after falling 8+ binades with most of the last steps skipped. The gradients overflow even
  unscaled; only a scale below 1 fits them, so FP16 has no headroom left for them (bf16, or keep
  the overflowing layer in FP32).
- ``never_growing``: more clean steps in a row than ``growth_interval`` and the scale never grew:
  ``scaler.update()`` is not called every step.
- ``oscillating``: skips after calibration with growth in between: the gradients sit at the
  edge of FP16's range and each growth overflows again.
- ``saturated``: the scale sits at 2^16 or above (up to about 2^24) and the history shows why:
  it bounced off a top there, came down from ``init_scale`` only that far, or grew to 2^24. The
  gradients are small and far from FP16's max. Healthy; near 2^24 check that the loss is not vanishing.
- ``climbing``: the scale is still growing: healthy, still searching upwards.
- ``calibrating``: a few skips at the start, each at a scale no step had been applied at yet, bring
  the scale down from ``init_scale``, then no more: GradScaler found the largest scale the
  gradients allow. Normal.
- ``stable``: the scale did not move (isolated skips, if any, are listed). A scale that never moved
  in fewer clean steps than ``growth_interval`` says nothing about the gradients' size: GradScaler
  never tried a larger one.

Every function is linear in the number of steps (numpy over the whole history; ``bench/bench_scaler.py``
times a 1e6-step log).

Recommendations give ``init_scale``, ``growth_interval`` and ``backoff_factor`` values computed
from the history (the scale the run settled at, the clean steps between skips, the runs of
consecutive skips), in ``ScaleFacts.settings`` and as ``Advice`` codes. No English here: the classes and the
advice are codes with their figures (``ScaleFacts.finding``, ``ScaleFacts.advice``), and
``ampdoctor.report.scaler`` words them (``report.words.scaler``).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ampdoctor.judge.thresholds import OUTLIER_RATIO

SATURATION = 2.0**16
"""Scales at or above 2^16 (up to about 2^24) mean the gradients are small and far from FP16's max."""
CEILING = 2.0**24
"""About where a scale that keeps growing ends up: FP16 gradients of 2^-24 (its smallest subnormal) reach 1."""
COLLAPSE_BINADES = 8
"""A fall of this many binades from the first scale, ending at the minimum with most steps skipped, is a collapse."""
DEFAULT_GROWTH_INTERVAL = 2000
DEFAULT_BACKOFF = 0.5
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


@dataclass
class SkipRun:
    """Consecutive skipped steps."""

    start: int
    end: int
    reasons: list[str]

    @property
    def length(self) -> int:
        return len(self.reasons)


@dataclass
class SkipLedger:
    """Which steps were skipped, why, at which scale, and the runs of consecutive skips."""

    steps: list[int]
    reasons: list[str]
    scales: list[float | None]
    runs: list[SkipRun]
    total_steps: int

    @property
    def count(self) -> int:
        return len(self.steps)

    @property
    def rate(self) -> float:
        return self.count / self.total_steps if self.total_steps else 0.0

    @property
    def longest_run(self) -> int:
        return max((r.length for r in self.runs), default=0)

    def by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.reasons:
            key = r or "(no reason logged)"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def skip_ledger(
    skipped: Sequence[bool],
    reasons: Sequence[str] | None = None,
    scales: Sequence[float | None] | None = None,
    steps: Sequence[int] | None = None,
) -> SkipLedger:
    """The skip ledger of a run. A run of consecutive skips is consecutive rows (steps)."""
    n = len(skipped)
    st = list(steps) if steps is not None else list(range(n))
    rs = reasons if reasons is not None else [""] * n
    sc: Sequence[float | None] = scales if scales is not None else [None] * n
    idx = np.flatnonzero(np.asarray(skipped, dtype=bool)).tolist()
    runs: list[SkipRun] = []
    for i in idx:
        if runs and i > 0 and skipped[i - 1] and runs[-1].end == st[i - 1]:
            runs[-1].end = st[i]
            runs[-1].reasons.append(rs[i])
        else:
            runs.append(SkipRun(st[i], st[i], [rs[i]]))
    return SkipLedger([st[i] for i in idx], [rs[i] for i in idx], [sc[i] for i in idx], runs, n)


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


def floor_pow2(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x)) if x > 0 and math.isfinite(x) else x


def _arrays(scales: Sequence[float], skipped: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(scales, dtype=np.float64), np.asarray(skipped, dtype=bool)


def infer_backoff(scales: Sequence[float], skipped: Sequence[bool]) -> float | None:
    """Median of ``scale[i+1] / scale[i]`` over skipped steps i where the scale fell."""
    sc, sk = _arrays(scales, skipped)
    a, b = sc[:-1], sc[1:]
    fell = sk[:-1] & (b > 0) & (b < a)
    ratios = (b[fell] / a[fell]).tolist()
    return float(statistics.median(ratios)) if ratios else None


def infer_growth_interval(scales: Sequence[float], skipped: Sequence[bool]) -> int | None:
    """Fewest clean steps (since the last skip or scale change) that preceded a growth."""
    sc, sk = _arrays(scales, skipped)
    if len(sc) < 2:
        return None
    grew = ~sk[:-1] & (sc[1:] > sc[:-1])
    # the clean count restarts after every skip and every scale change; between two restarts all steps are clean
    resets = np.flatnonzero(sk[:-1] | (sc[1:] != sc[:-1]))
    clean = np.diff(resets, prepend=-1)[grew[resets]]
    return int(clean.min()) if clean.size else None


def _clean_runs_between(skip_idx: list[int], n: int, skipped: Sequence[bool]) -> list[int]:
    """Clean steps between consecutive (non-adjacent) skips in ``skip_idx``."""
    if len(skip_idx) < 2:
        return []
    clean_before = np.concatenate([[0], np.cumsum(~np.asarray(skipped, dtype=bool))])  # clean steps in [0, i)
    idx = np.asarray(skip_idx)
    gaps = clean_before[idx[1:]] - clean_before[idx[:-1] + 1]
    return [int(g) for g in gaps if g]


def _nice(n: float) -> int:
    """Round up to 1, 2 or 5 times a power of ten (growth_interval values people type)."""
    if n <= 1:
        return 1
    e = 10 ** math.floor(math.log10(n))
    for m in (1, 2, 5, 10):
        if n <= m * e:
            return int(m * e)
    return int(10 * e)


def diagnose_scale(
    scales: Sequence[float],
    skipped: Sequence[bool],
    *,
    growth_interval: int | None = None,
    backoff_factor: float | None = None,
    init_scale: float | None = None,
    steps: Sequence[int] | None = None,
    nonfinite: Sequence[bool] | None = None,
) -> ScaleFacts:
    """Classify the history of a GradScaler (one scale used and one skip flag per step).

    ``nonfinite``: steps whose loss was non-finite (NaN/Inf from the data or the forward). Their skips are never
    calibration: no loss scale makes a forward value finite, so such a skip says nothing about the scale the gradients
    allow (they count with the skips after calibration, the batches to check).

    ``growth_interval`` and ``backoff_factor`` are the scaler's settings when known; otherwise
    they are inferred from the history (2000 and 0.5, PyTorch's defaults, when it shows none).
    ``steps`` names the rows (default 0..n-1); every step list in the result uses those names.
    A history too long to hold goes through ``ScaleTracker`` in chunks, with the same result.
    """
    t = ScaleTracker()
    t.feed(scales, skipped, steps, nonfinite)
    return t.diagnose(growth_interval=growth_interval, backoff_factor=backoff_factor, init_scale=init_scale)


def _longest_run(flags: Sequence[bool] | np.ndarray) -> int:
    f = np.asarray(flags, dtype=bool)
    if not f.any():
        return 0
    edges = np.flatnonzero(np.diff(np.concatenate([[0], f.astype(np.int8), [0]])))  # run starts, run ends
    return int((edges[1::2] - edges[::2]).max())


def rolling_skip_rate(skipped: Sequence[bool], window: int = 1000) -> list[float]:
    """Skip rate over the last ``window`` steps (fewer at the start), one value per step."""
    c = np.concatenate([[0], np.cumsum(np.asarray(skipped, dtype=np.int64))])
    i = np.arange(1, len(c))
    counts = c[1:] - c[np.maximum(i - window, 0)]
    return (counts / np.minimum(i, window)).tolist()


class _Grow:
    """A growable int64 (or float64) column kept as a list of numpy pieces: 8 bytes an entry."""

    def __init__(self, dtype: type = np.int64) -> None:
        self.parts: list[np.ndarray] = []
        self.dtype = dtype
        self.n = 0

    def add(self, a: np.ndarray) -> None:
        if a.size:
            self.parts.append(np.asarray(a, dtype=self.dtype))
            self.n += int(a.size)

    def array(self) -> np.ndarray:
        if len(self.parts) > 1:
            self.parts = [np.concatenate(self.parts)]
        return self.parts[0] if self.parts else np.zeros(0, dtype=self.dtype)

    def first(self, k: int) -> list[Any]:
        out: list[Any] = []
        for p in self.parts:
            out.extend(p[: k - len(out)].tolist())
            if len(out) >= k:
                break
        return out


def _longest_with_carry(f: np.ndarray, carry: int) -> tuple[int, int]:
    """(longest run of True in ``f`` counting ``carry`` Trues just before it, the run still open at its end)."""
    if not f.size:
        return carry, carry
    false = np.flatnonzero(~f)
    if not false.size:
        return carry + f.size, carry + f.size
    bounds = np.concatenate([[-1], false, [f.size]])
    lengths = np.diff(bounds) - 1
    lengths[0] += carry
    return int(lengths.max()), int(lengths[-1])


def _median_of(counts: Counter[float]) -> float:
    """``statistics.median`` of the multiset ``counts`` (value -> how many)."""
    m = sum(counts.values())
    lo, hi = (m - 1) // 2, m // 2
    seen, a, b = 0, math.nan, math.nan
    for v in sorted(counts):
        c = counts[v]
        if seen <= lo < seen + c:
            a = v
        if seen <= hi < seen + c:
            b = v
            break
        seen += c
    return a if lo == hi else (a + b) / 2


@dataclass
class _Reading:
    """What every branch of ``ScaleTracker.diagnose`` reads: the settings (given, seen or PyTorch's), the final scale."""

    gi: int
    bo: float
    gi_given: bool
    gi_seen: int | None
    bo_seen: float | None
    init: float
    final: float
    settled: float
    """The scale the calibration ended at (the final scale without calibration skips)."""
    n_later: int
    growths: list[int]
    any_backoff: bool
    tail_n: int
    tail_rate: float
    fell: float


class ScaleTracker:
    """Everything ``diagnose_scale`` reads from a history, taken chunk by chunk in memory that does not grow with
    the steps: running counts, minima and maxima, and the steps of the events (growths, back-offs, skips: 8 bytes each).

    ``feed(scales, skipped, steps)`` any number of times, in order, then ``diagnose(...)``. ``diagnose_scale`` is one
    feed of the whole history, so the two agree by construction.
    """

    def __init__(self) -> None:
        self.n = 0
        self.first_scale = math.nan
        self.last_scale = math.nan
        self.last_skipped = False
        self.smin = math.inf
        self.smax = -math.inf
        self.applied = False
        self.growth_steps, self.backoff_steps = _Grow(), _Grow()
        self.n_growths = 0
        self.first_growth_row = -1
        self.last_growth_row = -1
        self.last_backoff_row = -1
        self.scale_at_last_growth = math.nan
        self.min_before_growth = math.inf
        # growth interval: the clean rows since the last reset (a skip or a change of scale)
        self.last_reset = -1
        self.gi_min: int | None = None
        self.backoff_ratios: Counter[float] = Counter()
        # calibration: a skip before the first growth at a scale no applied step of its plateau used
        self.applied_in_plateau = False
        self.calib_count = 0
        self.last_calib_scale = math.nan
        # later skips
        self.later_steps = _Grow()
        self.later_min = math.inf
        self.later_recent: deque[float] = deque(maxlen=5)
        self.growths_at_first_later = -1
        self.growths_at_last_later = -1
        self.clean_before = 0
        self.clean_at_last_later = -1
        self.later_gaps: Counter[int] = Counter()
        # runs and the tail
        self.skip_rows = _Grow()
        self.skip_run = 0
        self.clean_run = 0
        self.longest_skip = 0
        self.longest_clean = 0
        # the plateau: the smallest applied scale in each binade, and the steps where the scale first reached a new high
        self.applied_min_by_binade: dict[int, float] = {}
        self.applied_nonpositive: set[float] = set()
        self.highs: list[tuple[float, int]] = []
        self.high = -math.inf

    def feed(self, scales: Sequence[float] | np.ndarray, skipped: Sequence[bool] | np.ndarray,
             steps: Sequence[int] | np.ndarray | None = None, nonfinite: Sequence[bool] | np.ndarray | None = None) -> None:
        sc = np.asarray(scales, dtype=np.float64)
        sk = np.asarray(skipped, dtype=bool)
        m = len(sc)
        if m == 0:
            return
        o = self.n
        st = np.arange(o, o + m, dtype=np.int64) if steps is None else np.asarray(steps, dtype=np.int64)
        rows = np.arange(o, o + m, dtype=np.int64)
        first = o == 0
        if first:
            self.first_scale = float(sc[0])
        prev = np.concatenate([[self.last_scale], sc[:-1]])
        prev_sk = np.concatenate([[self.last_skipped], sk[:-1]])
        grow = sc > prev
        back = sc < prev
        changed = sc != prev
        if first:
            grow[0] = back[0] = False
            changed[0] = True
        self.growth_steps.add(st[grow])
        self.backoff_steps.add(st[back])
        g_idx = np.flatnonzero(grow)
        b_idx = np.flatnonzero(back)
        growths_cum = self.n_growths + np.cumsum(grow)
        if not first or m > 1:
            lo = 0 if not first else 1
            self._feed_pairs(prev_sk[lo:], prev[lo:], sc[lo:], rows[lo:] - 1)
        calib = self._feed_calibration(sc, sk, changed, g_idx)
        if nonfinite is not None:  # a skip on a non-finite loss is never calibration (see diagnose_scale)
            nf = np.asarray(nonfinite, dtype=bool)
            if (calib & nf).any():
                self._uncount(sc, calib, nf)
                calib = calib & ~nf
        if g_idx.size:
            self.last_growth_row = o + int(g_idx[-1])
            self.scale_at_last_growth = float(sc[g_idx[-1]])
        if b_idx.size:
            self.last_backoff_row = o + int(b_idx[-1])
        self.n_growths = int(growths_cum[-1])
        self._feed_later(sc, sk, st, sk & ~calib, growths_cum)
        self.skip_rows.add(rows[sk])
        longest, self.skip_run = _longest_with_carry(sk, self.skip_run)
        self.longest_skip = max(self.longest_skip, longest)
        longest, self.clean_run = _longest_with_carry(~sk, self.clean_run)
        self.longest_clean = max(self.longest_clean, longest)
        self._feed_scales(sc, sk, st)
        self.n = o + m

    def _feed_pairs(self, a_sk: np.ndarray, a_sc: np.ndarray, b_sc: np.ndarray, j: np.ndarray) -> None:
        """The growth interval and the back-off ratios, from each row ``j`` (skip flag, scale) and the scale after it."""
        reset = a_sk | (b_sc != a_sc)  # the clean count restarts after every skip and every scale change
        grew = ~a_sk & (b_sc > a_sc)
        r = j[reset]
        if r.size:
            d = r - np.concatenate([[self.last_reset], r[:-1]])
            cand = d[grew[reset]]
            if cand.size:
                c = int(cand.min())
                self.gi_min = c if self.gi_min is None else min(self.gi_min, c)
            self.last_reset = int(r[-1])
        fell = a_sk & (b_sc > 0) & (b_sc < a_sc)
        if fell.any():
            vals, counts = np.unique(b_sc[fell] / a_sc[fell], return_counts=True)
            for v, c in zip(vals.tolist(), counts.tolist(), strict=True):
                self.backoff_ratios[v] += c

    def _feed_calibration(self, sc: np.ndarray, sk: np.ndarray, changed: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
        """The calibration skips of a chunk: before the first growth (there the scale only falls, so a scale is proven
        exactly when an applied step of its plateau came before)."""
        m = len(sc)
        calib = np.zeros(m, dtype=bool)
        if self.first_growth_row >= 0:
            return calib
        end = int(g_idx[0]) if g_idx.size else m
        if g_idx.size:
            self.first_growth_row = self.n + end
        if not end:
            return calib
        pre_sc, pre_sk, pre_ch = sc[:end], sk[:end], changed[:end]
        self.min_before_growth = min(self.min_before_growth, float(pre_sc.min()))
        app = (~pre_sk).astype(np.int64)
        before = np.cumsum(app) - app  # applied rows of this chunk before each row
        run_id = np.cumsum(pre_ch)  # 0: the plateau carried from the chunk before
        starts = np.flatnonzero(pre_ch)
        base = np.concatenate([[0], before[starts]])[run_id]
        proven = (before - base) > 0
        proven |= (run_id == 0) & self.applied_in_plateau
        calib[:end] = pre_sk & ~proven
        last_run = run_id[-1]
        self.applied_in_plateau = bool(((before[-1] + app[-1] - base[-1]) > 0) or (last_run == 0 and self.applied_in_plateau))
        ci = np.flatnonzero(calib)
        if ci.size:
            self.calib_count += int(ci.size)
            self.last_calib_scale = float(sc[ci[-1]])
        return calib

    def _uncount(self, sc: np.ndarray, calib: np.ndarray, nf: np.ndarray) -> None:
        """Take the calibration skips of this chunk that were made by a non-finite loss out of the calibration count."""
        self.calib_count -= int((calib & nf).sum())
        kept = np.flatnonzero(calib & ~nf)
        if kept.size:
            self.last_calib_scale = float(sc[kept[-1]])
        elif not self.calib_count:
            self.last_calib_scale = math.nan

    def _feed_later(self, sc: np.ndarray, sk: np.ndarray, st: np.ndarray, later: np.ndarray, growths_cum: np.ndarray) -> None:
        """The skips that are not calibration: their steps, scales, the growths around them and the clean steps between."""
        clean_cum = self.clean_before + np.cumsum(~sk)
        li = np.flatnonzero(later)
        if li.size:
            self.later_steps.add(st[li])
            self.later_min = min(self.later_min, float(sc[li].min()))
            self.later_recent.extend(sc[li[-5:]].tolist())
            if self.growths_at_first_later < 0:
                self.growths_at_first_later = int(growths_cum[li[0]])
            self.growths_at_last_later = int(growths_cum[li[-1]])
            cc = clean_cum[li]
            prev_c = np.concatenate([[self.clean_at_last_later], cc[:-1]])
            gaps = (cc - prev_c)[prev_c >= 0]
            gaps = gaps[gaps > 0]
            if gaps.size:
                vals, counts = np.unique(gaps, return_counts=True)
                for v, c in zip(vals.tolist(), counts.tolist(), strict=True):
                    self.later_gaps[v] += c
            self.clean_at_last_later = int(cc[-1])
        self.clean_before = int(clean_cum[-1])

    def _feed_scales(self, sc: np.ndarray, sk: np.ndarray, st: np.ndarray) -> None:
        """Applied scales by binade, the steps of each new high, the range, and the last row."""
        if (~sk).any():
            self.applied = True
            for v in np.unique(sc[~sk]).tolist():
                if v > 0 and math.isfinite(v):
                    b = math.floor(math.log2(v))
                    if v < self.applied_min_by_binade.get(b, math.inf):
                        self.applied_min_by_binade[b] = v
                elif v <= 0:
                    self.applied_nonpositive.add(v)
        running = np.maximum.accumulate(np.concatenate([[self.high], sc]))
        new_high = np.flatnonzero(sc > running[:-1])
        self.highs.extend(zip(sc[new_high].tolist(), st[new_high].tolist(), strict=True))
        self.high = float(running[-1])
        self.smin = min(self.smin, float(sc.min()))
        self.smax = max(self.smax, float(sc.max()))
        self.last_scale = float(sc[-1])
        self.last_skipped = bool(sk[-1])

    # read-outs --------------------------------------------------------------------------------
    def skips_in_last(self, k: int) -> int:
        rows = self.skip_rows.array()
        return int(rows.size - np.searchsorted(rows, self.n - k, side="left"))

    def max_safe_floor(self) -> float | None:
        """floor_pow2 of the largest applied scale below every later skip's scale; None when there is none."""
        below = [b for b, v in self.applied_min_by_binade.items() if v < self.later_min]
        if below:
            return 2.0 ** max(below)
        neg = [v for v in self.applied_nonpositive if v < self.later_min]
        return max(neg) if neg else None

    def first_step_at_least(self, level: float) -> int:
        return next((s for v, s in self.highs if v >= level), self.highs[0][1] if self.highs else 0)

    def diagnose(self, *, growth_interval: int | None = None, backoff_factor: float | None = None,
                 init_scale: float | None = None) -> ScaleFacts:
        """The diagnosis of the history fed so far (see ``diagnose_scale``)."""
        if self.n == 0:
            return empty()
        r = self._reading(growth_interval, backoff_factor, init_scale)
        pattern, finding, advice, settings = self._classify(r)
        if self.calib_count and pattern != "collapsed" and "init_scale" not in settings:
            settings["init_scale"] = r.settled
            advice.insert(0, Advice("init_scale_calibration", r.settled, count=self.calib_count))
        if r.n_later and pattern in ("stable", "calibrating"):
            advice.append(Advice("check_isolated_skips", steps=tuple(self.later_steps.first(10))))
        return ScaleFacts(
            pattern, finding, self.calib_count, self.later_steps.array().tolist(), r.growths,
            self.backoff_steps.array().tolist(), advice, settings, r.gi_seen, r.bo_seen,
            # the scale after the last update belongs to the range too: a skip at the last step takes the
            # scale below every scale used, and "final 2^13, min 2^14" would contradict itself
            min(self.smin, r.final), self.smax, r.final,
        )

    def _reading(self, growth_interval: int | None, backoff_factor: float | None, init_scale: float | None) -> _Reading:
        gi_inf = self.gi_min
        bo_inf = float(_median_of(self.backoff_ratios)) if self.backoff_ratios else None
        gi = growth_interval or gi_inf or DEFAULT_GROWTH_INTERVAL
        bo = backoff_factor or bo_inf or DEFAULT_BACKOFF
        final = self.last_scale * (bo if self.last_skipped else 1.0)
        tail_n = max(1, self.n // 4)
        return _Reading(
            gi, bo, bool(growth_interval), growth_interval or gi_inf, backoff_factor or bo_inf,
            init_scale if init_scale is not None else self.first_scale, final,
            self.last_calib_scale * bo if self.calib_count else final, self.later_steps.n,
            self.growth_steps.array().tolist(), bool(self.backoff_steps.n), tail_n, self.skips_in_last(tail_n) / tail_n,
            math.log2(self.first_scale / self.smin) if self.smin > 0 else math.inf,
        )

    def _classify(self, r: _Reading) -> tuple[Pattern, ScaleFinding, list[Advice], dict[str, float]]:
        advice: list[Advice] = []
        settings: dict[str, float] = {}
        cycles = self.growths_at_last_later - self.growths_at_first_later if r.n_later >= 2 else 0
        if self.smin < 1.0 or not self.applied or (self.last_scale <= self.smin and r.fell >= COLLAPSE_BINADES
                                                    and r.tail_rate >= 0.5):
            advice += [Advice("use_bf16"), Advice("keep_layer_fp32")]
            if self.longest_skip >= 2:
                self._backoff(r, "backoff_bad_batches", advice, settings)
            return "collapsed", Collapsed(self.first_scale, self.smin, r.fell, self.applied, r.tail_rate, r.tail_n), \
                advice, settings
        if self.longest_clean >= r.gi and not r.growths:
            return "never_growing", NeverGrowing(self.longest_clean, r.gi, r.gi_given), \
                [Advice("call_update_every_step")], settings
        if r.n_later >= 2 and cycles > 0:
            return "oscillating", self._oscillating(r, cycles, advice, settings), advice, settings
        if r.final >= SATURATION and (r.n_later or (r.any_backoff and not r.growths) or r.final >= CEILING):
            # evidence that the gradients are small: the scale bounced off a top at 2^16 or more, came down
            # from init_scale only as far as 2^16 or more, or kept growing to 2^24; a scale that never
            # moved is no evidence (it is "stable")
            return "saturated", self._saturated(r, advice, settings), advice, settings
        if r.growths and self.last_growth_row >= self.last_backoff_row:
            return "climbing", self._climbing(r, advice, settings), advice, settings
        if self.calib_count and not r.n_later:
            return "calibrating", Calibrating(self.calib_count, r.init, r.settled), advice, settings
        if not r.growths and not r.any_backoff and not r.n_later:
            return "stable", Unmoved(self.last_scale, self.n, r.gi, not r.gi_seen), advice, settings
        return "stable", Stable(self.last_scale, self.smin, self.smax, r.n_later), advice, settings

    def _backoff(self, r: _Reading, code: AdviceCode, advice: list[Advice], settings: dict[str, float]) -> None:
        b = min(0.8, max(0.7, round(math.sqrt(r.bo), 2)))
        if b > r.bo + 1e-9:
            settings["backoff_factor"] = b
            advice.append(Advice(code, b, current=r.bo, count=self.longest_skip))

    def _gap(self, r: _Reading) -> int:
        """The median clean steps between later skips (growth_interval when there is no gap)."""
        return int(_median_of(self.later_gaps)) if self.later_gaps else r.gi  # type: ignore[arg-type]

    def _oscillating(self, r: _Reading, cycles: int, advice: list[Advice], settings: dict[str, float]) -> Oscillating:
        m = self._gap(r)
        new_gi = _nice(max(2 * r.gi, 2 * m))
        settings["growth_interval"] = new_gi
        advice.append(Advice("growth_interval_recurring", new_gi, count=m))
        recent = list(self.later_recent)
        held = floor_pow2(min(recent) * r.bo)
        if abs(held - r.init) > 1e-9 * r.init:
            settings["init_scale"] = held
            advice.append(Advice("init_scale_held", held, count=len(recent)))
        self._backoff(r, "backoff_near_ceiling", advice, settings)
        return Oscillating(r.n_later, cycles, m)

    def _saturated(self, r: _Reading, advice: list[Advice], settings: dict[str, float]) -> Saturated:
        safe = self.max_safe_floor()
        plateau = safe if safe is not None else floor_pow2(r.final)
        if plateau > r.init * 1.0001:
            settings["init_scale"] = plateau
            advice.append(Advice("init_scale_plateau", plateau, step=self.first_step_at_least(plateau)))
        if r.n_later:
            new_gi = _nice(2 * max(r.gi, self._gap(r)))
            settings["growth_interval"] = new_gi
            advice.append(Advice("growth_interval_bounced", new_gi, count=r.n_later))
        return Saturated(r.final, r.final >= CEILING)

    def _climbing(self, r: _Reading, advice: list[Advice], settings: dict[str, float]) -> Climbing:
        k = len(r.growths)
        if floor_pow2(r.final) > r.init * 1.0001:
            settings["init_scale"] = floor_pow2(r.final)
            advice.append(Advice("init_scale_reached", floor_pow2(r.final), count=self.n))
        if k >= 2 and r.gi > 1:
            new_gi = max(1, r.gi // 2)
            settings["growth_interval"] = new_gi
            advice.append(Advice("growth_interval_faster", new_gi, count=k))
        return Climbing(k, self.min_before_growth, self.scale_at_last_growth, r.gi)


@dataclass
class RunSummary:
    """One run of consecutive skipped steps, as the ledger shows it: its span, its reasons (each once), its scale."""

    start: int
    end: int
    length: int
    reasons: list[str]
    scale: float | None


class LedgerTracker:
    """``skip_ledger``'s figures for a log read in chunks: counts, reasons, runs (the first ``keep`` in full)."""

    def __init__(self, keep: int = 20) -> None:
        self.keep = keep
        self.total = 0
        self.count = 0
        self.by_reason: Counter[str] = Counter()
        self.runs: list[RunSummary] = []
        self.n_runs = 0
        self.longest = 0
        self._open = 0
        """Length of the run still open at the end of what was fed (0: the last row was applied)."""
        self._open_tracked = False

    def feed(self, steps: np.ndarray, skipped: np.ndarray, reasons: np.ndarray, scales: np.ndarray | None) -> None:
        m = len(steps)
        if m == 0:
            return
        self.total += m
        li = np.flatnonzero(skipped)
        if not li.size:
            self._open = 0
            return
        rs = reasons[li].astype(str)
        vals, first_at, counts = np.unique(rs, return_index=True, return_counts=True)
        for k in np.argsort(first_at, kind="stable").tolist():  # in the order they first appear, as skip_ledger counts
            self.by_reason[str(vals[k]) or "(no reason logged)"] += int(counts[k])
        self.count += int(li.size)
        new = np.ones(li.size, dtype=bool)
        new[1:] = np.diff(li) > 1
        starts = np.flatnonzero(new)
        lengths = np.diff(np.append(starts, li.size))
        runs_len = lengths.copy()
        cont = bool(self._open and li[0] == 0)  # the first piece continues the run the last chunk ended in
        if cont:
            runs_len[0] += self._open
            if self._open_tracked:
                r, ln = self.runs[-1], int(lengths[0])
                r.end = int(steps[li[ln - 1]])
                r.length += ln
                r.reasons.extend(x for x in dict.fromkeys(rs[:ln].tolist()) if x not in r.reasons)
        self.longest = max(self.longest, int(runs_len.max()))
        fresh = starts.size - int(cont)
        self.n_runs += fresh
        head = slice(int(cont), int(cont) + max(0, self.keep - len(self.runs)))
        for s0, ln in zip(starts[head].tolist(), lengths[head].tolist(), strict=True):
            self.runs.append(RunSummary(int(steps[li[s0]]), int(steps[li[s0 + ln - 1]]), ln,
                                        list(dict.fromkeys(rs[s0:s0 + ln].tolist())),
                                        None if scales is None else float(scales[li[s0]])))
        if fresh:
            self._open_tracked = self.n_runs <= self.keep
        run_len = int(runs_len[-1])
        self._open = run_len if skipped[-1] else 0

    @property
    def rate(self) -> float:
        return self.count / self.total if self.total else 0.0

    def reasons_by_count(self) -> dict[str, int]:
        return dict(sorted(self.by_reason.items(), key=lambda kv: -kv[1]))


class RateTracker:
    """``rolling_skip_rate`` read out as the scaler report does (final, peak and where, steps above the alert rate),
    for a log read in chunks; the skips of the last ``window`` steps are kept (8 bytes each)."""

    def __init__(self, window: int, alert_rate: float) -> None:
        self.window = window
        self.alert = alert_rate
        self.s0 = min(window, 100)
        self.n = 0
        self.skips = np.zeros(0, dtype=np.int64)
        self.dropped = 0
        self.total_skips = 0
        self.final = 0.0
        # (peak, step at the peak, steps above the alert rate) judged from row s0, and from row 0
        self.from_s0: tuple[float, int, int] | None = None
        self.from_0: tuple[float, int, int] | None = None
        self.step_s0 = 0
        self.first_step = 0

    def feed(self, steps: np.ndarray, skipped: np.ndarray) -> None:
        m = len(steps)
        if m == 0:
            return
        o = self.n
        if o == 0:
            self.first_step = int(steps[0])
        g = np.arange(o, o + m, dtype=np.int64)
        self.skips = np.concatenate([self.skips, g[skipped]])
        c_i = self.total_skips + np.cumsum(skipped, dtype=np.int64)
        c_lo = self.dropped + np.searchsorted(self.skips, g + 1 - self.window, side="left")
        rates = (c_i - c_lo) / np.minimum(g + 1, self.window)
        self.total_skips = int(c_i[-1])
        self.final = float(rates[-1])
        self.from_0 = self._merge(self.from_0, rates, steps)
        if o + m > self.s0:
            lo = max(0, self.s0 - o)
            if lo < m and o + lo == self.s0:
                self.step_s0 = int(steps[lo])
            self.from_s0 = self._merge(self.from_s0, rates[lo:], steps[lo:])
        keep = np.searchsorted(self.skips, o + m - self.window, side="left")
        self.dropped += int(keep)
        self.skips = self.skips[keep:]
        self.n = o + m

    def _merge(self, acc: tuple[float, int, int] | None, rates: np.ndarray, steps: np.ndarray) -> tuple[float, int, int]:
        if not rates.size:
            return acc  # type: ignore[return-value]
        k = int(np.argmax(rates))
        peak, at, over = float(rates[k]), int(steps[k]), int((rates > self.alert).sum())
        if acc is None:
            return peak, at, over
        return (acc[0], acc[1], acc[2] + over) if acc[0] >= peak else (peak, at, acc[2] + over)

    def summary(self) -> tuple[float, int, float, int, int]:
        """(final rate, the first judged step, peak, step at the peak, steps above the alert rate)."""
        if self.n > self.s0 and self.from_s0 is not None:
            return self.final, self.step_s0, *self.from_s0
        assert self.from_0 is not None
        return self.final, self.first_step, *self.from_0


class Envelope:
    """At most about ``2 * cap`` points of a long series for a plot: consecutive points in buckets of ``width``
    (1, 2, 4, ...: the width doubles when the buckets pass ``2 * cap``), each bucket its first x and its true
    minimum and maximum y. With width 1 the points are the series itself."""

    def __init__(self, cap: int = 4000) -> None:
        self.cap = cap
        self.width = 1
        self.n = 0
        self.ids = np.zeros(0, dtype=np.int64)
        self.x = np.zeros(0, dtype=np.float64)
        self.lo = np.zeros(0, dtype=np.float64)
        self.hi = np.zeros(0, dtype=np.float64)

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        m = len(x)
        if m == 0:
            return
        ids = (self.n + np.arange(m, dtype=np.int64)) // self.width
        self.n += m
        self._put(ids, np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), np.asarray(y, dtype=np.float64))
        while len(self.ids) > 2 * self.cap:
            self.width *= 2
            ids, x0, lo, hi = self.ids // 2, self.x, self.lo, self.hi
            self.ids = np.zeros(0, dtype=np.int64)
            self.x = self.lo = self.hi = np.zeros(0, dtype=np.float64)
            self._put(ids, x0, lo, hi)

    def _put(self, ids: np.ndarray, x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        if self.ids.size and ids[0] == self.ids[-1]:  # the open bucket continues
            ids = np.concatenate([self.ids[-1:], ids])
            x = np.concatenate([self.x[-1:], x])
            lo = np.concatenate([self.lo[-1:], lo])
            hi = np.concatenate([self.hi[-1:], hi])
            self.ids, self.x, self.lo, self.hi = self.ids[:-1], self.x[:-1], self.lo[:-1], self.hi[:-1]
        starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
        self.ids = np.concatenate([self.ids, ids[starts]])
        self.x = np.concatenate([self.x, x[starts]])
        self.lo = np.concatenate([self.lo, np.minimum.reduceat(lo, starts)])
        self.hi = np.concatenate([self.hi, np.maximum.reduceat(hi, starts)])


class LogDigest:
    """What ``ampdoctor scaler`` reports about one step log, taken from its frames in order (one frame, or a block
    at a time): the scale diagnosis, the skip ledger, the rolling skip rate, the applied non-finite steps and the
    plot's series, in memory that does not grow with the rows.

    ``first_scale`` is the log's first non-empty ``scaler_scale`` (the scale of the rows before it, as
    ``StepLog.scales`` fills them), None when the column is empty throughout (a run without GradScaler).
    An empty cell later takes the scale of the row before. A scale that is zero, negative or infinite stops the
    digest: ``bad`` is its (step, value).
    """

    def __init__(self, window: int, alert_rate: float, first_scale: float | None, *, keep_runs: int = 20,
                 plot: bool = False) -> None:
        self.has_scale = first_scale is not None
        self.scale = ScaleTracker() if self.has_scale else None
        self.ledger = LedgerTracker(keep_runs)
        self.rates = RateTracker(window, alert_rate)
        self.carry = first_scale
        self.n = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.applied = 0
        self.first_applied: tuple[int, str] | None = None
        self.bad: tuple[int, float] | None = None
        self.plot = plot
        self.scale_env, self.skip_env, self.loss_env = Envelope(), Envelope(), Envelope()

    def feed(self, frame: Any) -> bool:
        """Take one frame (typed as ``read_step_log`` types it); False once a bad scale stopped the digest."""
        if self.bad is not None:
            return False
        st = frame["step"].to_numpy(dtype=np.int64)
        if not st.size:
            return True
        sk = frame["skipped"].to_numpy(dtype=bool)
        reasons = frame["skip_reason"].to_numpy(dtype=object)
        sc: np.ndarray | None = None
        if self.has_scale:
            raw = frame["scaler_scale"].to_numpy(dtype=np.float64)
            if np.isnan(raw).any():
                ffilled = frame["scaler_scale"].astype("float64").ffill().to_numpy(dtype=np.float64)
                raw = np.where(np.isnan(ffilled), self.carry, ffilled)
            sc = raw
            self.carry = float(sc[-1])
            bad = np.flatnonzero(~((sc > 0) & np.isfinite(sc)))
            if bad.size:
                self.bad = (int(st[bad[0]]), float(sc[bad[0]]))
                return False
        if self.first_step is None:
            self.first_step = int(st[0])
        self.last_step = int(st[-1])
        self.n += st.size
        if self.scale is not None and sc is not None:
            self.scale.feed(sc, sk, st)
        self.ledger.feed(st, sk, reasons, sc)
        self.rates.feed(st, sk)
        ok = ~sk
        if ok.any():
            applied = ok & np.char.startswith(reasons.astype(str), "applied:")
            k = np.flatnonzero(applied)
            if k.size:
                self.applied += int(k.size)
                if self.first_applied is None:
                    self.first_applied = (int(st[k[0]]), str(reasons[k[0]]))
        if self.plot:
            x = st.astype(np.float64)
            if sc is not None:
                self.scale_env.add(x, sc)
                self.skip_env.add(x[sk], sc[sk])
            else:
                self.skip_env.add(x[sk], np.zeros(int(sk.sum())))
            loss = frame["loss"].to_numpy(dtype=np.float64)
            fin = np.isfinite(loss)
            self.loss_env.add(x[fin], loss[fin])
        return True
