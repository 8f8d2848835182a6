"""GradScaler forensics: classify a scale history and recommend scaler settings from it.

Pure functions over the per-step scale (the scale *used* by each step) and skip flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SATURATION = 2.0**16
"""Scales at or above 2^16 (up to about 2^24) mean the gradients are small and far from FP16's max."""


@dataclass
class ScaleDiagnosis:
    pattern: str
    """calibrating | stable | climbing | saturated | oscillating | collapsed | never_growing | empty"""
    explanation: str
    calibration_skips: int
    """Skips that took the scale to a new low on its way down from init_scale."""
    later_skips: list[int]
    """Skipped steps after the first applied step."""
    growths: list[int]
    backoffs: list[int]
    recommendations: list[str] = field(default_factory=list)


def _pow2(x: float) -> str:
    if x <= 0 or not math.isfinite(x):
        return repr(x)
    k = math.log2(x)
    return f"2**{int(k)}" if k == int(k) else f"{x:g}"


def diagnose_scale(
    scales: list[float],
    skipped: list[bool],
    *,
    growth_interval: int = 2000,
    backoff_factor: float = 0.5,
    init_scale: float | None = None,
) -> ScaleDiagnosis:
    """Classify the history of a GradScaler (one scale and skip flag per step)."""
    n = len(scales)
    if n == 0:
        return ScaleDiagnosis("empty", "no steps were recorded", 0, [], [], [])
    init = init_scale if init_scale is not None else scales[0]
    growths = [i for i in range(1, n) if scales[i] > scales[i - 1]]
    backoffs = [i for i in range(1, n) if scales[i] < scales[i - 1]]
    first_applied = next((i for i, s in enumerate(skipped) if not s), None)
    # a calibration skip brings the scale to a new low on its way down from init_scale; a skip
    # at a scale the history has already come down from (after a growth) is an oscillation
    calib_steps = [i for i in range(n) if skipped[i] and (i == 0 or scales[i] <= min(scales[:i]))]
    calib = len(calib_steps)
    later = [i for i in range(n) if skipped[i] and i not in set(calib_steps)]
    final, smin = scales[-1], min(scales)
    recs: list[str] = []
    longest_clean = _longest_run([not s for s in skipped])

    if smin < 1.0 or first_applied is None:
        pattern = "collapsed"
        expl = (
            f"the scale fell to {smin:g}" + (" (below 1)" if smin < 1 else "")
            + (" and no step was ever applied" if first_applied is None else "")
            + ": gradients overflow FP16 even unscaled, so no loss scale can help"
        )
        recs.append("use bf16 autocast (no scaler needed) if the device supports it")
        recs.append("or keep the layer whose gradients overflow in FP32, and normalise the loss (mean, not sum)")
    elif len(later) >= 2 and len(growths) >= 1:
        pattern = "oscillating"
        expl = (
            f"{len(later)} skips after calibration with growth in between: the gradients sit at the edge "
            "of FP16's range and each growth overflows again"
        )
        recs.append("backoff_factor=0.75 (gentler back-off for unstable models)")
        recs.append(f"growth_interval={max(2 * growth_interval, 2 * longest_clean)} (grow less often)")
    elif longest_clean >= growth_interval and not growths:
        pattern = "never_growing"
        expl = (
            f"{longest_clean} clean steps in a row (growth_interval={growth_interval}) and the scale never grew: "
            "scaler.update() is probably not called every step"
        )
        recs.append("call scaler.update() after every step, on the skip path too")
    elif final >= SATURATION and (later or not growths):
        pattern = "saturated"
        expl = f"the scale sits at {_pow2(final)}: gradients are small and far from FP16's max; this is healthy"
    elif growths and growths[-1] >= (backoffs[-1] if backoffs else -1):
        pattern = "climbing"
        expl = f"the scale grows every {growth_interval} clean steps: healthy, still searching upwards"
    elif calib > 0 and not later:
        pattern = "calibrating"
        expl = (
            f"{calib} skip(s) while the scale came down from {_pow2(init)} to {_pow2(min(scales) * (backoff_factor if skipped[scales.index(min(scales))] else 1.0))}; "
            "normal: GradScaler finds the largest scale the gradients allow"
        )
    else:
        pattern = "stable"
        expl = f"the scale stayed at {_pow2(final)}" + (f" with {len(later)} isolated skip(s)" if later else "")

    if calib > 0 and pattern != "collapsed":
        settled = min(scales) * (backoff_factor if skipped[scales.index(min(scales))] else 1.0)
        recs.insert(0, f"init_scale={_pow2(settled)} skips the {calib} calibration step(s)")
    if later and pattern in ("stable", "calibrating"):
        recs.append(f"isolated skips at steps {', '.join(map(str, later[:10]))}: check those batches")
    return ScaleDiagnosis(pattern, expl, calib, later, growths, backoffs, recs)


def _longest_run(flags: list[bool]) -> int:
    best = cur = 0
    for f in flags:
        cur = cur + 1 if f else 0
        best = max(best, cur)
    return best


def rolling_skip_rate(skipped: list[bool], window: int = 1000) -> list[float]:
    """Skip rate over the last ``window`` steps (fewer at the start), one value per step."""
    out, acc = [], 0
    for i, s in enumerate(skipped):
        acc += int(s)
        if i >= window:
            acc -= int(skipped[i - window])
        out.append(acc / min(i + 1, window))
    return out
