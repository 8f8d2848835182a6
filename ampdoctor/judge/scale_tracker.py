"""``ScaleTracker``: one pass over a scale history, a step at a time (or a whole array), that classifies it
(``scale_facts.Pattern``) and works out the settings to recommend; ``scaler.diagnose_scale`` runs it over a
history, ``log_digest.LogDigest`` over a step log. Linear in the steps (``bench/bench_scaler.py``)."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ampdoctor.judge.scale_facts import (
    CEILING,
    COLLAPSE_BINADES,
    DEFAULT_BACKOFF,
    DEFAULT_GROWTH_INTERVAL,
    SATURATION,
    Advice,
    AdviceCode,
    Calibrating,
    Climbing,
    Collapsed,
    NeverGrowing,
    Oscillating,
    Pattern,
    Saturated,
    ScaleFacts,
    ScaleFinding,
    Stable,
    Unmoved,
    empty,
)


def floor_pow2(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x)) if x > 0 and math.isfinite(x) else x


def _nice(n: float) -> int:
    """Round up to 1, 2 or 5 times a power of ten (growth_interval values people type)."""
    if n <= 1:
        return 1
    e = 10 ** math.floor(math.log10(n))
    for m in (1, 2, 5, 10):
        if n <= m * e:
            return int(m * e)
    return int(10 * e)


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
