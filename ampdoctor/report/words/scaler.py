"""The English of a GradScaler history: what its class means (``explain``) and each recommendation (``advise``).

``ampdoctor.judge.scaler`` returns codes and figures (``ScaleFacts``: a ``ScaleFinding`` and ``Advice`` items);
these functions write them, every scale in one notation (``pow2``: 2^k) and every setting as a user types it
(``setting``: the number and its power of two). Steps arrive in the run's own numbering (the judge reads
them from the history it was given), so no sentence is renumbered afterwards.
"""

from __future__ import annotations

from ampdoctor.fmt import pow2 as _fmt_pow2
from ampdoctor.fmt import sentences
from ampdoctor.judge.scale_facts import (
    Advice,
    Calibrating,
    Climbing,
    Collapsed,
    Empty,
    NeverGrowing,
    Oscillating,
    Saturated,
    ScaleFacts,
    ScaleFinding,
    Stable,
    Unmoved,
)


def pow2(x: float) -> str:
    """2^k for exact powers of two, else the number: the one notation every sentence uses."""
    return _fmt_pow2(x, "^")


def setting(x: float) -> str:
    """A scale as a setting a user types: the number, with its power of two ('16384 (2^14)')."""
    p = _fmt_pow2(x, "^")
    return f"{x:g}" + (f" ({p})" if p.startswith("2^") and p != f"{x:g}" else "")


def _collapsed(f: Collapsed) -> str:
    parts = [f"the scale fell from {pow2(f.first)} to {pow2(f.low)} ({f.binades:.0f} binades)"]
    if f.low < 1:
        parts.append("below 1")
    if not f.applied:
        parts.append("and no step was ever applied")
    else:
        parts.append(f"and {f.tail_rate:.0%} of the last {f.tail_steps} steps were skipped")
    return (", ".join(parts) + ": steps overflow whatever the scale, so either the gradients overflow FP16 "
            "even unscaled (only a scale below 1 fits them, and every growth overflows again) or the forward "
            "pass is non-finite, which no loss scale changes")


def _stable(f: Stable) -> str:
    moved = f.low != f.high
    s = (f"the scale held at {pow2(f.high)}, then {pow2(f.scale)} after the back-off(s)" if moved else
         f"the scale stayed at {pow2(f.scale)}")
    return s + ((("," if moved else "") + f" with {f.isolated} isolated skip(s)") if f.isolated else "")


def explain(f: ScaleFinding) -> str:
    """What the history's class means, with its figures (one clause, lower case: ``sentences`` capitalises it)."""
    match f:
        case Empty(no_scaler=True):
            return "no GradScaler: no scale history"
        case Empty():
            return "no steps were recorded"
        case Collapsed():
            return _collapsed(f)
        case NeverGrowing():
            return (f"{f.clean_run} clean steps in a row (growth_interval={f.growth_interval}{'' if f.given else ', assumed'}) "
                    "and the scale never grew: scaler.update() is probably not called every step")
        case Oscillating():
            return (f"{f.skips} skips after calibration with {f.cycles} growth(s) in between, about {f.gap} clean steps "
                    "apart: the gradients sit at the edge of FP16's range and each growth overflows again")
        case Saturated():
            return (f"the scale sits at {pow2(f.scale)}: the gradients are small and far from FP16's max; this is healthy"
                    + ("; at 2^24 even FP16's smallest subnormal gradient reaches 1: check that the loss is not vanishing"
                       if f.ceiling else ""))
        case Climbing():
            return (f"the scale grew {f.growths} time(s), from {pow2(f.low)} to {pow2(f.high)}, every {f.growth_interval} "
                    "clean steps and has not overflowed since: healthy, still searching upwards")
        case Calibrating():
            return (f"{f.skips} skip(s) while the scale came down from {pow2(f.init)} to {pow2(f.settled)}; "
                    "normal: GradScaler finds the largest scale the gradients allow")
        case Stable():
            return _stable(f)
        case Unmoved():
            return (f"the scale stayed at {pow2(f.scale)} for all {f.steps} step(s): no overflow, and fewer clean steps than "
                    f"growth_interval={f.growth_interval}{' (assumed)' if f.assumed else ''}, so GradScaler never tried a "
                    "larger scale; the history cannot tell how far the gradients are from FP16's limits")
    raise AssertionError(f)  # pragma: no cover  (every ScaleFinding has its words)


_BACKOFF_WHY = {
    "backoff_bad_batches": "if the overflows come from a few bad batches, a gentler back-off loses less scale per skip",
    "backoff_near_ceiling": "a gentler back-off keeps the scale nearer the ceiling between overflows",
}


def _backoff(a: Advice) -> str:
    b, bo, run = a.value, a.current, a.count
    return (f"backoff_factor={b:g}: {_BACKOFF_WHY[a.code]}; a run of {run} consecutive skips cuts the scale "
            f"to {bo**run:.3g} times itself with {bo:g}, to {b**run:.3g} times with {b:g}")


def advise(a: Advice) -> str:
    """One recommendation: the setting with its value, and why (lower case where it starts with a word)."""
    v = a.value
    match a.code:
        case "use_bf16":
            return "use bf16 autocast (no scaler needed) if the device supports it"
        case "keep_layer_fp32":
            return "or keep the layer whose gradients overflow in FP32, and normalise the loss (mean, not sum)"
        case "backoff_bad_batches" | "backoff_near_ceiling":
            return _backoff(a)
        case "call_update_every_step":
            return "call scaler.update() after every step, on the skip path too"
        case "growth_interval_recurring":
            m, gi = a.count, int(v)
            return (f"growth_interval={gi}: skips recur about every {m} clean steps (skip rate about 1/{m + 1}), soon after "
                    f"each growth; waiting {gi} steps to grow cuts that to about 1/{gi + 1}")
        case "init_scale_held":
            return f"init_scale={setting(v)}: the scale that held between the last {a.count} overflows"
        case "init_scale_plateau":
            return f"init_scale={setting(v)} starts at the plateau this run reached at step {a.step}"
        case "growth_interval_bounced":
            return f"growth_interval={int(v)}: the scale bounced off its top {a.count} time(s); growing less often skips less"
        case "init_scale_reached":
            return f"init_scale={setting(v)} starts where this run got after {a.count} steps"
        case "growth_interval_faster":
            return f"growth_interval={int(v)}: {a.count} growths without an overflow; growing twice as often finds the top sooner"
        case "init_scale_calibration":
            return f"init_scale={setting(v)} skips the {a.count} calibration step(s)"
        case "check_isolated_skips" if len(a.batches) == 1:
            return f"isolated skips on one batch, {_by_batch(a.batches)}: check that batch"
        case "check_isolated_skips" if a.batches:
            return f"isolated skips on {len(a.batches)} batches: {_by_batch(a.batches)}: check those batches"
        case "check_isolated_skips":
            return f"isolated skips at steps {', '.join(str(s) for s in a.steps)}: check those batches"
    raise AssertionError(a.code)  # pragma: no cover  (every AdviceCode has its words)


def _by_batch(groups: tuple[tuple[int, tuple[int, ...]], ...]) -> str:
    """'batch 7, seen at steps 7, 19, 31 ...; batch 2 at step 2' (a cycled dataloader's batch said once)."""
    def one(b: int, steps: tuple[int, ...]) -> str:
        if len(steps) == 1:
            return f"batch {b} at step {steps[0]}"
        return f"batch {b}, seen at steps {', '.join(map(str, steps[:3]))}" + (" ..." if len(steps) > 3 else "")
    return "; ".join(one(b, s) for b, s in groups[:10])


def recommendations(d: ScaleFacts) -> list[str]:
    return [advise(a) for a in d.advice]


def story(d: ScaleFacts) -> str:
    """The history's explanation and its recommendations as sentences (the report's GradScaler section)."""
    return sentences([explain(d.finding), *recommendations(d)])
