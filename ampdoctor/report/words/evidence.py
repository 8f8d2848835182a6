"""A finding's evidence as sentences (``evidence``: one line per key, by ``_EVIDENCE``), and the places in the
source an op is found at (``OP_PLACES``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ampdoctor.fmt import fixed, gen, num, pct0, pow2
from ampdoctor.formats import FP16
from ampdoctor.report.words import inside
from ampdoctor.report.words.common import PHASES, Facts, g3, g4, hooks_in


def _share(x: Any) -> str:
    """A share of elements for a sentence: '0.2%', 'under 0.1%', '0'."""
    x = float(x)
    return "none" if x == 0 else "under 0.1%" if x < 0.001 else f"{x:.1%}"


def _named_shares(d: Mapping[str, Any], limit: int = 5) -> str:
    items = list(d.items())
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(f"{k} {_share(v)}" for k, v in items[:limit]) + more


def _ev_recheck(ev: Facts) -> str | None:
    if "fp32_recheck_finite" not in ev and "fp32_recheck_loss" not in ev:
        return None
    where = f" ({ev['fp32_recheck_weights']})" if ev.get("fp32_recheck_weights") else ""
    loss = ev.get("fp32_recheck_loss")
    if ev.get("fp32_recheck_finite", True):
        return (f"Re-run in FP32 from the same weights{where}, the step stays finite"
                + (f" (loss {g4(loss)})." if loss is not None else "."))
    return f"Re-run in FP32 from the same weights{where}, the step is non-finite too" + (
        f" (loss {g4(loss)})." if loss is not None else ".")


def _ev_range(ev: Facts, module: str | None) -> str | None:
    amax = ev.get("fp32_absmax")
    if amax is None:
        return None
    inside = f" in {module}" if module else ""
    what = f"The `{ev['op']}` op{inside}" if ev.get("op") else f"The output of {module}" if module else "The output"
    fmax = float(ev.get("fp16_max", FP16.max))
    s = f"{what} reaches {g4(amax)} in FP32"
    amax = float(amax)
    if amax > fmax:
        s += f", {g3(amax / fmax)} times FP16's largest value {gen(fmax)} (headroom {fixed(FP16.headroom_binades(amax))} binades)"
    else:
        s += f", within FP16's largest value {gen(fmax)} (headroom {fixed(FP16.headroom_binades(amax))} binades)"
    if ev.get("op_overflow_frac") is not None:
        s += f"; {_share(ev['op_overflow_frac'])} of its elements overflow FP16"
    return s + "."


OP_PLACES = {"loss": "loss function", "model_loss": "model's forward (its loss)", "root": "model's forward"}
"""Where the first op that made NaN/Inf ran (evidence ``op_in``, a code of the rule's): its words."""


def _ev_op_place(ev: Facts) -> str | None:
    if not ev.get("op") or ev.get("fp32_absmax") is not None:
        return None
    where = f" in the {ev['op_in']}" if ev.get("op_in") else ""
    line = f", at {ev['op_line']}" if ev.get("op_line") else ""
    return f"The first op to make NaN/Inf is `{ev['op']}`{where}{line}."


def _ev_step(ev: Facts) -> str | None:
    parts = []
    if "loss" in ev:
        parts.append(f"the loss is {g4(ev['loss'])}")
    if "grad_l2" in ev:
        parts.append(f"the gradient norm (L2, before clipping) is {g4(ev['grad_l2'])}")
    if "max_grad_l2_before" in ev:
        parts.append(f"the largest gradient norm of the steps before is {g4(ev['max_grad_l2_before'])}")
    if not parts:
        return None
    s = "At that step " + ", ".join(parts) + "."
    if "replay_from_initial_weights_finite" in ev:
        loss = ev.get("replay_loss")
        ok = ev["replay_from_initial_weights_finite"]
        # the replay fails on a finite loss when only its gradients are non-finite (a fault made in backward)
        fin = "finite" if ok or _finite(loss) else "non-finite"
        s += f" The same batch from the initial weights gives a {fin} loss" + (
            f" ({g4(loss)})" if loss is not None else "") + ("" if ok or not _finite(loss) else " but non-finite gradients") + "."
    return s


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _ev_scaler(ev: Facts) -> str | None:
    if "min_scale" not in ev and "skipped_steps" not in ev:
        return None
    s = (f"GradScaler skipped {ev.get('skipped_steps', 0)} step(s) and its scale went down to "
         f"{pow2(ev.get('min_scale'))}" + (f" (pattern: {ev['pattern']})" if ev.get("pattern") else "") + ".")
    return s


def _ev_grad_fp32(ev: Facts) -> str | None:
    if "grad_l2_fp32_step" not in ev:
        return None
    return f"FP32's gradient norm (L2) at that step is {g4(ev['grad_l2_fp32_step'])}."


def _ev_scaled_param(ev: Facts) -> str | None:
    if "fp32_grad_absmax_x_scale" not in ev:
        return None
    return (f"{ev.get('parameter')}'s largest FP32 gradient times the loss scale is {g3(ev['fp32_grad_absmax_x_scale'])}, "
            f"above FP16's largest value {gen(float(ev.get('fp16_max', FP16.max)))}.")


def _ev_progress(ev: Facts) -> str | None:
    if ev.get("progress_vs_fp32") is None:
        return None
    return f"The loss makes {pct0(float(ev['progress_vs_fp32']))} of FP32's progress."


def _ev_flushed(ev: Facts) -> str | None:
    fl = ev.get("flushed")
    if not isinstance(fl, Mapping) or not fl:
        return None
    s = f"Share of each gradient that flushes to zero: {_named_shares(fl)}."
    if ev.get("largest_fp32_grad") is not None:
        s += f" The largest FP32 gradient is {g3(ev['largest_fp32_grad'])}"
        s += f"; the largest loss scale that still fits it is {str(ev['largest_safe_scale']).replace('**', '^')}." if ev.get(
            "largest_safe_scale") else "."
    return s


def _ev_moved(ev: Facts) -> str | None:
    mv = ev.get("weight_movement_vs_fp32")
    if not isinstance(mv, Mapping) or not mv:
        return None
    return f"How far each weight moves, as a share of its FP32 movement: {_named_shares(mv)}."


def _ev_swallowed(ev: Facts) -> str | None:
    if "lost_update_share" not in ev:
        return None
    s = f"{_share(ev['lost_update_share'])} of the FP32 updates are lost in FP16 weights."
    if ev.get("optimizer_constants_underflowing"):
        s += f" Optimizer constants that round to 0 in FP16: {', '.join(map(str, ev['optimizer_constants_underflowing']))}."
    return s


def _ev_scaler_normal(ev: Facts) -> str | None:
    if "phase" not in ev:
        return None
    s = f"GradScaler was at scale {pow2(ev.get('scale'))}, {PHASES.get(str(ev['phase']), 'backing off')}."
    if ev.get("grad_absmax_unscaled"):
        s += f" Unscaled, the largest gradient is {g3(ev['grad_absmax_unscaled'])}"
        s += f" ({fixed(float(ev['headroom_binades']))} binades of FP16 headroom)." if ev.get("headroom_binades") is not None else "."
    return s


def _ev_captured(ev: Facts) -> str | None:
    if "captured_reason" not in ev:
        return None
    s = (f"The run captured the step for {str(ev['captured_reason']).replace('_', ' ')}: loss {num(ev.get('captured_loss'))}, "
         f"gradient norm {num(ev.get('captured_grad_l2'))}, scale {pow2(_float(ev.get('captured_scale')))}.")
    if "replays" in ev:
        s += f" {ev.get('replays_failed', 0)} of {ev['replays']} replay(s) failed again."
    return s


def _float(x: Any) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _ev_data(ev: Facts) -> str | None:
    if "field" not in ev:
        return None
    samples = ev.get("samples")
    at = f" (samples {list(samples)[:10]})" if samples else ""
    if ev.get("nonfinite") is not None:
        return f"Field {ev['field']!r} holds {ev['nonfinite']} NaN/Inf value(s){at}."
    if ev.get("ratio_to_median") is not None:
        return f"Field {ev['field']!r} is {g3(ev['ratio_to_median'])} times the median batch's magnitude{at}."
    return None


def _ev_error(ev: Facts) -> str | None:
    msg = ev.get("error") or ev.get("message")
    if not msg:
        return None
    fn = f" in custom autograd.Function {ev['function']}" if ev.get("function") else ""
    return f"The error{fn}: {msg}."


def _ev_hooks(ev: Facts) -> str | None:
    return f"Gradient hooks on the model: {hooks_in(list(ev['hooks']))}." if ev.get("hooks") else None


_EVIDENCE: tuple[tuple[Callable[[Facts], str | None], tuple[str, ...]], ...] = (
    (_ev_op_place, ("op", "op_line", "op_in")),
    (_ev_recheck, ("fp32_recheck_loss", "fp32_recheck_finite", "fp32_recheck_weights")),
    (_ev_step, ("loss", "grad_l2", "max_grad_l2_before", "replay_from_initial_weights_finite", "replay_loss")),
    (_ev_scaler, ("min_scale", "skipped_steps", "pattern")),
    (_ev_grad_fp32, ("grad_l2_fp32_step",)),
    (_ev_scaled_param, ("parameter", "fp32_grad_absmax_x_scale", "fp16_max")),
    (_ev_flushed, ("flushed", "largest_fp32_grad", "largest_safe_scale")),
    (_ev_moved, ("weight_movement_vs_fp32",)),
    (_ev_swallowed, ("lost_update_share", "optimizer_constants_underflowing")),
    (_ev_scaler_normal, ("scale", "phase", "grad_absmax_unscaled", "headroom_binades")),
    (_ev_captured, ("captured_reason", "captured_loss", "captured_grad_l2", "captured_scale", "replays", "replays_failed",
                    "replay_results")),
    (_ev_data, ("field", "nonfinite", "ratio_to_median", "samples")),
    (_ev_error, ("error", "message", "function")),
    (_ev_hooks, ("hooks",)),
    (_ev_progress, ("progress_vs_fp32",)),
)
"""Evidence facts → a sentence, in reading order after the range sentence (``_ev_range``); each names the keys it tells."""
_EVIDENCE += inside.EVIDENCE


def evidence(ev: Facts, module: str | None = None) -> list[str]:
    """A finding's evidence (``Finding.evidence``, kept as data in the JSON) as sentences with their units;
    ``module``: the finding's module. A key no sentence tells is written as 'name: value', so no fact is dropped."""
    out: list[str] = []
    told: set[str] = set()
    first = _ev_range(ev, module)
    if first:
        out.append(first)
        told.update(("fp32_absmax", "fp16_max", "op", "op_overflow_frac"))
    for words, keys in _EVIDENCE:
        s = words(ev)
        if s:
            out.append(s)
            told.update(keys)
    for k, v in ev.items():
        if k not in told and not k.startswith("_") and v is not None:
            out.append(f"{k.replace('_', ' ')}: {num(v) if not isinstance(v, (list, dict)) else v}.")
    return out
