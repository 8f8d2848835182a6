"""The rules of the first group (``rules.RULES`` runs them first): FP32 itself fails, so the cause is the data, a
user hook, or a model bug, not the precision. Each takes a ``Ctx`` and returns an ``Outcome`` or None."""

from __future__ import annotations

import math
from typing import Any

from ampdoctor.input.batches import check_batch
from ampdoctor.judge import locate
from ampdoctor.judge.context import Ctx
from ampdoctor.judge.explosion import first_explosion
from ampdoctor.judge.measures import first_bad_step, outlier_field
from ampdoctor.judge.refine import masked_facts
from ampdoctor.records import Finding, Fix, Outcome, UserHook, nonfinite
from ampdoctor.records import stats_at as _stats_at


def fp32_raised(c: Ctx) -> Outcome | None:
    """The FP32 reference raised: a model bug, whatever the precision."""
    e = c.fp32.error
    if e is None:
        return None
    facts = {"variant": "fp32_raised", "type": e.type, "message": e.message, "module": e.module, "step": e.step}
    return Outcome("model_bug", e.module, e.step, "fp32", facts,
                   [Finding("model_bug", "error", stage="fp32", module=e.module, step=e.step, evidence={"message": e.message})],
                   [Fix("fix_exception", {"type": e.type, "module": e.module, "step": e.step, "message": e.message})])


def fp32_nonfinite_data(c: Ctx) -> Outcome | None:
    """FP32 goes non-finite on a batch that holds NaN/Inf: the data."""
    s = first_bad_step(c.fp32, amp=False)
    if s is None:
        return None
    bad_fields = [fc for fc in check_batch(c.batches[s]) if fc.nonfinite]
    if not bad_fields:
        return None
    fc, b = bad_fields[0], c.batches.index(s)
    facts = {"variant": "fp32_data_nonfinite", "step": s, "batch": b, "field": fc.field, "count": fc.nonfinite,
             "samples": list(fc.samples)}
    return Outcome("data", None, b, "fp32", facts,
                   [Finding("data", "error", stage="fp32", step=b,
                            evidence={"field": fc.field, "nonfinite": fc.nonfinite, "samples": fc.samples})],
                   [Fix("filter_nonfinite_batch", {"batch": b, "field": fc.field, "samples": list(fc.samples)})])


def fp32_outlier(c: Ctx) -> Outcome | None:
    """FP32 goes non-finite on a batch orders of magnitude larger than the median batch: the data."""
    s = first_bad_step(c.fp32, amp=False)
    out = outlier_field(c.batches, s) if s is not None else None
    if s is None or out is None:
        return None
    field_, ratio, samples = out
    b = c.batches.index(s)
    facts = {"variant": "fp32_data_outlier", "step": s, "batch": b, "field": field_, "ratio": ratio, "samples": samples}
    return Outcome("data", None, b, "fp32", facts,
                   [Finding("data", "error", stage="fp32", step=b,
                            evidence={"field": field_, "ratio_to_median": ratio, "samples": samples})],
                   [Fix("outlier_batch", {"batch": b, "field": field_, "samples": samples, "ratio": ratio})])


def hook_hid_overflow(c: Ctx) -> Outcome | None:
    """amp: a gradient hook of the user's made an overflow finite, so GradScaler applied the step.

    From the definition, at one step of the amp stage: the FP16 gradients are non-finite before the hook (a replay
    of the step without the user's hooks gives non-finite scaled gradients; or a gradient the backward recorded
    upstream of a module backward hook is non-finite), GradScaler never saw an inf (with the hooks on, every
    parameter's gradient is finite), and the update was applied (the step was not skipped). Ordered before
    ``model_bug``: the weights that such an update ruins fail in FP32 too, from then on."""
    tgt = c.tgt
    if c.tgt_name != "amp" or tgt is None or not c.hook_list:
        return None
    found = _hidden_seen_by_probe(c) or _hidden_at_applied_step(c) or _hidden_by_module_hook(c)
    if found is None:
        return None
    step, params, module, hooks, how = found
    rec = tgt.records[step]
    ref = c.fp32.records[step].grad_l2_pre_clip if step < len(c.fp32.records) else math.nan
    ev: dict[str, Any] = {"hooks": [h.describe() for h in hooks], "scale": rec.scaler_scale,
                          "applied_grad_l2": rec.grad_l2_pre_clip, "fp32_grad_l2": ref, "how": how}
    if params:
        ev["nonfinite_without_hooks"] = params[:10]
    facts = {"variant": "hook_hid_overflow", "step": step, "module": module, "hooks": [h.describe() for h in hooks],
             "hook": hooks[0].describe() if hooks else None, "ops": sorted({o for h in hooks for o in h.ops}),
             "params": len(params), "param": params[0] if params else None, "scale": rec.scaler_scale,
             "norm": rec.grad_l2_pre_clip, "fp32_norm": ref, "how": how}
    return Outcome("amp_misuse", module, step, "amp", facts,
                   [Finding("amp_misuse", "error", stage="amp", module=module, step=step, evidence=ev)],
                   [Fix("let_scaler_see", {"hooks": [h.describe() for h in hooks]})])


def _hooks_on(c: Ctx, names: list[str]) -> list[UserHook]:
    """The user's hooks on these parameters / modules (a module's hooks also for its parameters), in that order."""
    out: list[UserHook] = []
    for n in names:
        for h in c.hook_list:
            if h not in out and (h.name == n or (h.target == "module" and (n.startswith(h.name + ".") or h.name == locate.MODEL))):
                out.append(h)
    return out


def _module_of(name: str, hooks: list[UserHook]) -> str:
    """A hooked module's name as it is; a parameter's module."""
    if any(h.target == "module" and h.name == name for h in hooks):
        return name
    return name.rsplit(".", 1)[0] if "." in name else locate.MODEL


def _hidden_seen_by_probe(c: Ctx) -> tuple[int, list[str], str | None, list[UserHook], str] | None:
    """The first applied step at which a user's hook was handed a non-finite gradient (``StageResult.hook_inputs_nonfinite``)."""
    tgt = c.tgt
    assert tgt is not None
    for step in sorted(tgt.hook_inputs_nonfinite):
        if step < len(tgt.records) and not tgt.records[step].skipped:
            names = tgt.hook_inputs_nonfinite[step]
            hooks = _hooks_on(c, names)
            params = [n for n in names if not any(h.target == "module" and h.name == n for h in c.hook_list)]
            return step, params, _module_of(names[0], hooks), hooks or list(c.hook_list), "probe"
    return None


def _hidden_at_applied_step(c: Ctx) -> tuple[int, list[str], str | None, list[UserHook], str] | None:
    """The first step applied with a non-finite or exploding norm whose replay without the hooks overflows."""
    tgt = c.tgt
    assert tgt is not None
    step = tgt.applied_step
    if step is None or c.hook_check is None or tgt.records[step].skipped:
        return None
    hc = c.hook_check("amp", step)
    if hc is None or hc.kept or not hc.stripped:
        return None
    hidden = set(hc.stripped)
    hooks = [h for h in c.hook_list if h.target == "parameter" and h.name in hidden]
    hooks += [h for h in c.hook_list if h.target == "module" and any(
        p.startswith(h.name + ".") or h.name == locate.MODEL for p in hidden)]
    hooks = hooks or list(c.hook_list)
    st = _stats_at(tgt, step)
    order = {m: i for i, m in enumerate(locate.backward_order(st))} if st is not None else {}
    params = sorted(hc.stripped, key=lambda n: order.get(n.rsplit(".", 1)[0] if "." in n else locate.MODEL, 1 << 30))
    first = params[0]
    return step, params, first.rsplit(".", 1)[0] if "." in first else locate.MODEL, hooks, "replay_without_hooks"


def _hidden_by_module_hook(c: Ctx) -> tuple[int, list[str], str | None, list[UserHook], str] | None:
    """An applied step whose backward recorded a non-finite gradient at the output of a module carrying a backward
    hook while every parameter gradient is finite: the module's hook made it finite before GradScaler looked."""
    tgt = c.tgt
    assert tgt is not None
    hooked = {h.name: h for h in c.hook_list if h.target == "module"}
    if not hooked:
        return None
    for rec, st in zip(tgt.records, tgt.stats, strict=False):
        if rec.skipped or any(nonfinite(r) > 0 for r in st.pgrad.values()):
            continue
        for call in st.calls:
            if call.module in hooked and any(t in st.grad and nonfinite(st.grad[t]) > 0 for t in call.outputs):
                return rec.step, [], call.module, [hooked[call.module]], "module_hook_input"
    return None


def fp32_model_bug(c: Ctx) -> Outcome | None:
    """FP32 goes non-finite on finite data: diverged weights (the batch trains from the initial
    weights) or a bug in the model or loss."""
    s = first_bad_step(c.fp32, amp=False)
    if s is None:
        return None
    st = _stats_at(c.fp32, s)
    module = locate.locate_forward(st) if st is not None else None
    where = "forward"
    if module is None and st is not None and locate.backward_fault(st):
        module = locate.locate_backward(st)
        where = "backward"
    rc = c.recheck("initial", s)
    rec = c.fp32.records[s]
    ev: dict[str, Any] = {"loss": rec.loss, "grad_l2": rec.grad_l2_pre_clip}
    if rc is not None:
        ev.update(replay_from_initial_weights_finite=rc.finite, replay_loss=rc.loss)
    facts: dict[str, Any] = {"step": s, "batch": c.batches.index(s), "module": module}
    if rc is not None and rc.finite:
        norms = [r.grad_l2_pre_clip for r in c.fp32.records[:s] if math.isfinite(r.grad_l2_pre_clip)]
        gmax = max(norms) if norms else float("nan")
        ev["max_grad_l2_before"] = gmax
        facts.update(variant="fp32_diverged", steps_before=s, max_grad_l2=gmax)
        fix = Fix("lower_lr")
    else:
        loc = "module" if module else "loss" if st is not None and not locate.forward_fault(st) else "model"
        facts.update(variant="fp32_bug", where=where, location=loc)
        # the fix follows the mechanism: a softmax row masked throughout is 0/0 (the mask), not a domain error
        mr = rc.masked(module) if rc is not None and rc.masked is not None and module and where == "forward" else None
        if mr is not None:
            facts.update(masked=masked_facts(mr))
            ev["fully_masked_rows"] = masked_facts(mr)
            fix = Fix("unmask_row", {"module": module, **masked_facts(mr)})
        else:
            fix = Fix("guard_op", {"module": module})
    return Outcome("model_bug", module, s, "fp32", facts,
                   [Finding("model_bug", "error", stage="fp32", module=module, step=s, evidence=ev)], [fix])


def fp32_exploded(c: Ctx) -> Outcome | None:
    """A captured ``exploding_update`` that FP32 shares: FP32's own applied steps explode by the Monitor's definition
    (``judge.explosion.explodes``) at or before the captured step, so the failure does not depend on the precision: the
    training itself diverges (a model bug, however finite its numbers stay)."""
    if c.captured is None or c.captured[0] != "exploding_update" or c.fp32.error is not None:
        return None
    captured = c.captured[1]
    ex = first_explosion([(r.step, r.grad_l2_pre_clip, r.skipped) for r in c.fp32.records if r.step <= captured])
    if ex is None:
        return None
    losses = [r.loss for r in c.fp32.records if math.isfinite(r.loss)]
    top = max(losses) if losses else float("nan")
    ratio = ex.norm / ex.typical
    facts: dict[str, Any] = {"variant": "fp32_exploded", "step": ex.step, "captured_step": captured, "grad_l2": ex.norm,
                             "typical": ex.typical, "history": ex.history, "ratio": ratio, "max_loss": top,
                             "first_loss": c.fp32.records[0].loss if c.fp32.records else float("nan"),
                             "clipped": c.cfg.max_norm is not None}
    ev = {"grad_l2": ex.norm, "median_grad_l2_before": ex.typical, "applied_steps_before": ex.history,
          "ratio": ratio, "fp32_max_loss": top}
    fixes = [Fix("tame_schedule", {"step": ex.step}), Fix("clip_update", {"clipped": facts["clipped"]}), Fix("loss_scale_objective")]
    return Outcome("model_bug", None, ex.step, "fp32", facts,
                   [Finding("model_bug", "error", stage="fp32", step=ex.step, evidence=ev)], fixes)
