"""The quadratic scaler.py this rewrite replaced, kept as the reference its linear version is checked against.

GradScaler forensics: classify a scale history, list the skips, and recommend scaler settings.

Pure functions over a run's per-step history: the scale each step *used* (``scaler.get_scale()``
before that step's ``update()``, the ``scaler_scale`` column of the step log) and its skip flag.
The scale after step ``i``'s update is the scale step ``i + 1`` used, so a skip at step ``i``
shows as ``scales[i + 1] < scales[i]`` and a growth as ``scales[i + 1] > scales[i]``.

Patterns (``ScaleDiagnosis.pattern``), each with its meaning:

- ``collapsed``: the scale fell below 1, no step was ever applied, or it ended at its minimum
  after falling 8+ binades with most of the last steps skipped. The gradients overflow even
  unscaled; only a scale below 1 fits them, so FP16 has no headroom left for them (bf16, or keep
  the overflowing layer in FP32).
- ``never_growing``: more clean steps in a row than ``growth_interval`` and the scale never grew:
  ``scaler.update()`` is not called every step.
- ``oscillating``: skips after calibration with growth in between: the gradients sit at the
  edge of FP16's range and each growth overflows again.
- ``saturated``: the scale sits at 2^16 or above (up to about 2^24): the gradients are small and
  far from FP16's max. Healthy; near 2^24 check that the loss is not vanishing.
- ``climbing``: the scale is still growing: healthy, still searching upwards.
- ``calibrating``: a few skips at the start bring the scale down from ``init_scale``, then no
  more: GradScaler found the largest scale the gradients allow. Normal.
- ``stable``: the scale did not move (isolated skips, if any, are listed).

Recommendations give ``init_scale``, ``growth_interval`` and ``backoff_factor`` values computed
from the history (the scale the run settled at, the clean steps between skips, the runs of
consecutive skips), in ``ScaleDiagnosis.settings`` and as sentences.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

SATURATION = 2.0**16
"""Scales at or above 2^16 (up to about 2^24) mean the gradients are small and far from FP16's max."""
CEILING = 2.0**24
"""About where a scale that keeps growing ends up: FP16 gradients of 2^-24 (its smallest subnormal) reach 1."""
COLLAPSE_BINADES = 8
"""A fall of this many binades from the first scale, ending at the minimum with most steps skipped, is a collapse."""
DEFAULT_GROWTH_INTERVAL = 2000
DEFAULT_BACKOFF = 0.5


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
    rs = list(reasons) if reasons is not None else [""] * n
    sc: list[float | None] = list(scales) if scales is not None else [None] * n
    idx = [i for i in range(n) if skipped[i]]
    runs: list[SkipRun] = []
    for i in idx:
        if runs and i > 0 and skipped[i - 1] and runs[-1].end == st[i - 1]:
            runs[-1].end = st[i]
            runs[-1].reasons.append(rs[i])
        else:
            runs.append(SkipRun(st[i], st[i], [rs[i]]))
    return SkipLedger([st[i] for i in idx], [rs[i] for i in idx], [sc[i] for i in idx], runs, n)


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
    max_scale: float = math.nan
    final_scale: float = math.nan
    """The scale after the last step's update, where the history shows it (else the last scale used)."""


def pow2(x: float) -> str:
    """2^k for exact powers of two, else the number."""
    if x <= 0 or not math.isfinite(x):
        return repr(x)
    k = math.log2(x)
    return f"2^{int(k)}" if k == int(k) else f"{x:g}"


def setting(x: float) -> str:
    """A scale as a setting: the number, with its power of two."""
    p = pow2(x)
    return f"{x:g}" + (f" ({p})" if p.startswith("2^") and p != f"{x:g}" else "")


_pow2 = pow2  # older name


def floor_pow2(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x)) if x > 0 and math.isfinite(x) else x


def infer_backoff(scales: Sequence[float], skipped: Sequence[bool]) -> float | None:
    """Median of ``scale[i+1] / scale[i]`` over skipped steps i where the scale fell."""
    ratios = [scales[i + 1] / scales[i] for i in range(len(scales) - 1)
              if skipped[i] and 0 < scales[i + 1] < scales[i]]
    return float(statistics.median(ratios)) if ratios else None


def infer_growth_interval(scales: Sequence[float], skipped: Sequence[bool]) -> int | None:
    """Fewest clean steps (since the last skip or scale change) that preceded a growth."""
    runs: list[int] = []
    clean = 0
    for i in range(len(scales) - 1):
        if skipped[i]:
            clean = 0
            continue
        clean += 1
        if scales[i + 1] > scales[i]:
            runs.append(clean)
            clean = 0
        elif scales[i + 1] < scales[i]:
            clean = 0
    return min(runs) if runs else None


def _clean_runs_between(skip_idx: list[int], n: int, skipped: Sequence[bool]) -> list[int]:
    """Clean steps between consecutive (non-adjacent) skips in ``skip_idx``."""
    out = []
    for a, b in zip(skip_idx, skip_idx[1:], strict=False):
        gap = sum(1 for i in range(a + 1, b) if not skipped[i])
        if gap:
            out.append(gap)
    return out


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
) -> ScaleDiagnosis:
    """Classify the history of a GradScaler (one scale used and one skip flag per step).

    ``growth_interval`` and ``backoff_factor`` are the scaler's settings when known; otherwise
    they are inferred from the history (2000 and 0.5, PyTorch's defaults, when it shows none).
    ``steps`` names the rows (default 0..n-1); every step list in the result uses those names.
    """
    n = len(scales)
    if n == 0:
        return ScaleDiagnosis("empty", "no steps were recorded", 0, [], [], [])
    sc = [float(s) for s in scales]
    sk = [bool(s) for s in skipped]
    st = list(steps) if steps is not None else list(range(n))
    gi_given, bo_given = growth_interval, backoff_factor
    gi_inf, bo_inf = infer_growth_interval(sc, sk), infer_backoff(sc, sk)
    gi = gi_given or gi_inf or DEFAULT_GROWTH_INTERVAL
    bo = bo_given or bo_inf or DEFAULT_BACKOFF
    init = init_scale if init_scale is not None else sc[0]

    growth_i = [i for i in range(1, n) if sc[i] > sc[i - 1]]
    backoff_i = [i for i in range(1, n) if sc[i] < sc[i - 1]]
    applied = [i for i in range(n) if not sk[i]]
    # a calibration skip brings the scale to a new low on its way down from init_scale; a skip
    # at a scale the history has already come down from (after a growth) is an oscillation
    # ... at a scale no applied step has used yet (a skip at a proven scale is that step's own failure)
    calib_i = [i for i in range(n) if sk[i] and (i == 0 or sc[i] <= min(sc[:i])) and not any(g <= i for g in growth_i)
               and not any(not sk[j] and sc[j] == sc[i] for j in range(i))]
    later_i = [i for i in range(n) if sk[i] and i not in set(calib_i)]
    smin, smax = min(sc), max(sc)
    final = sc[-1] * (bo if sk[-1] else 1.0)
    ledger = skip_ledger(sk, None, None, list(range(n)))
    longest_skip_run = ledger.longest_run
    longest_clean = _longest_run([not s for s in sk])
    tail = sk[-max(1, n // 4):]
    tail_rate = sum(tail) / len(tail)
    fell = math.log2(sc[0] / smin) if smin > 0 else math.inf
    recs: list[str] = []
    settings: dict[str, float] = {}
    # the scale the run settled at: after the calibration skips, the largest scale that was applied
    settled = final
    if calib_i:
        settled = sc[calib_i[-1]] * bo
    safe = [sc[i] for i in applied if not later_i or sc[i] < min(sc[j] for j in later_i)]

    def backoff_rec(why: str) -> None:
        b = min(0.8, max(0.7, round(math.sqrt(bo), 2)))
        if b > bo + 1e-9:
            settings["backoff_factor"] = b
            lost = bo**longest_skip_run
            recs.append(
                f"backoff_factor={b:g}: {why}; a run of {longest_skip_run} consecutive skips cuts the scale "
                f"to {lost:.3g} times itself with {bo:g}, to {b**longest_skip_run:.3g} times with {b:g}"
            )

    if smin < 1.0 or not applied or (sc[-1] <= smin and fell >= COLLAPSE_BINADES and tail_rate >= 0.5):
        pattern = "collapsed"
        parts = [f"the scale fell from {pow2(sc[0])} to {pow2(smin)} ({fell:.0f} binades)"]
        if smin < 1:
            parts.append("below 1")
        if not applied:
            parts.append("and no step was ever applied")
        else:
            parts.append(f"and {tail_rate:.0%} of the last {len(tail)} steps were skipped")
        expl = (", ".join(parts) + ": steps overflow whatever the scale, so either the gradients overflow FP16 even "
                "unscaled (only a scale below 1 fits them, and every growth overflows again) or the forward pass is "
                "non-finite, which no loss scale changes")
        recs.append("use bf16 autocast (no scaler needed) if the device supports it")
        recs.append("or keep the layer whose gradients overflow in FP32, and normalise the loss (mean, not sum)")
        if longest_skip_run >= 2:
            backoff_rec("if the overflows come from a few bad batches, a gentler back-off loses less scale per skip")
    elif longest_clean >= gi and not growth_i:
        pattern = "never_growing"
        expl = (
            f"{longest_clean} clean steps in a row (growth_interval={gi}{'' if gi_given else ', assumed'}) and the scale never grew: "
            "scaler.update() is probably not called every step"
        )
        recs.append("call scaler.update() after every step, on the skip path too")
    elif len(later_i) >= 2 and any(later_i[0] < g <= later_i[-1] for g in growth_i):
        pattern = "oscillating"
        gaps = _clean_runs_between(later_i, n, sk)
        m = int(statistics.median(gaps)) if gaps else gi
        cycles = sum(1 for g in growth_i if later_i[0] < g <= later_i[-1])
        expl = (
            f"{len(later_i)} skips after calibration with {cycles} growth(s) in between, about {m} clean steps apart: "
            "the gradients sit at the edge of FP16's range and each growth overflows again"
        )
        new_gi = _nice(max(2 * gi, 2 * m))
        settings["growth_interval"] = new_gi
        recs.append(
            f"growth_interval={new_gi}: skips recur about every {m} clean steps (skip rate about 1/{m + 1}), soon after "
            f"each growth; waiting {new_gi} steps to grow cuts that to about 1/{new_gi + 1}"
        )
        recent = later_i[-5:]
        held = floor_pow2(min(sc[i] for i in recent) * bo)
        if abs(held - init) > 1e-9 * init:
            settings["init_scale"] = held
            recs.append(f"init_scale={setting(held)}: the scale that held between the last {len(recent)} overflows")
        backoff_rec("a gentler back-off keeps the scale nearer the ceiling between overflows")
    elif final >= SATURATION and (later_i or not growth_i or final >= CEILING):
        pattern = "saturated"
        expl = f"the scale sits at {pow2(final)}: the gradients are small and far from FP16's max; this is healthy"
        if final >= CEILING:
            expl += "; at 2^24 even FP16's smallest subnormal gradient reaches 1: check that the loss is not vanishing"
        plateau = floor_pow2(max(safe) if safe else final)
        if plateau > init * 1.0001:
            first = next(i for i in range(n) if sc[i] >= plateau)
            settings["init_scale"] = plateau
            recs.append(f"init_scale={setting(plateau)} starts at the plateau this run reached at step {st[first]}")
        if later_i:
            gaps = _clean_runs_between(later_i, n, sk) or [gi]
            new_gi = _nice(2 * max(gi, int(statistics.median(gaps))))
            settings["growth_interval"] = new_gi
            recs.append(f"growth_interval={new_gi}: the scale bounced off its top {len(later_i)} time(s); growing less often skips less")
    elif growth_i and growth_i[-1] >= (backoff_i[-1] if backoff_i else -1):
        pattern = "climbing"
        k = len(growth_i)
        expl = (
            f"the scale grew {k} time(s), from {pow2(min(sc[: growth_i[0]]))} to {pow2(sc[growth_i[-1]])}, "
            f"every {gi} clean steps and has not overflowed since: healthy, still searching upwards"
        )
        if floor_pow2(final) > init * 1.0001:
            settings["init_scale"] = floor_pow2(final)
            recs.append(f"init_scale={setting(floor_pow2(final))} starts where this run got after {n} steps")
        if k >= 2 and gi > 1:
            new_gi = max(1, gi // 2)
            settings["growth_interval"] = new_gi
            recs.append(f"growth_interval={new_gi}: {k} growths without an overflow; growing twice as often finds the top sooner")
    elif calib_i and not later_i:
        pattern = "calibrating"
        expl = (
            f"{len(calib_i)} skip(s) while the scale came down from {pow2(init)} to {pow2(settled)}; "
            "normal: GradScaler finds the largest scale the gradients allow"
        )
    else:
        pattern = "stable"
        expl = (f"the scale stayed at {pow2(sc[-1])}" if smin == smax else
                f"the scale held at {pow2(smax)}, then {pow2(sc[-1])} after the back-off(s)")
        expl += (("," if smin != smax else "") + f" with {len(later_i)} isolated skip(s)") if later_i else ""

    if calib_i and pattern != "collapsed" and "init_scale" not in settings:
        settings["init_scale"] = settled
        recs.insert(0, f"init_scale={setting(settled)} skips the {len(calib_i)} calibration step(s)")
    if later_i and pattern in ("stable", "calibrating"):
        recs.append(f"isolated skips at steps {', '.join(str(st[i]) for i in later_i[:10])}: check those batches")
    return ScaleDiagnosis(
        pattern, expl, len(calib_i), [st[i] for i in later_i], [st[i] for i in growth_i], [st[i] for i in backoff_i],
        recs, settings, gi_given or gi_inf, bo_given or bo_inf, smin, smax, final,
    )


def _longest_run(flags: Sequence[bool]) -> int:
    best = cur = 0
    for f in flags:
        cur = cur + 1 if f else 0
        best = max(best, cur)
    return best


def rolling_skip_rate(skipped: Sequence[bool], window: int = 1000) -> list[float]:
    """Skip rate over the last ``window`` steps (fewer at the start), one value per step."""
    out, acc = [], 0
    for i, s in enumerate(skipped):
        acc += int(s)
        if i >= window:
            acc -= int(skipped[i - window])
        out.append(acc / min(i + 1, window))
    return out
