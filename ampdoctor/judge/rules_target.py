"""The rules of the second group (``rules.RULES``): FP32 is sound and the target stage fails: it raised (a custom
Function's dtype, a kernel the device lacks), a batch beyond the format's range or an outlier, damaged weights, the
forward overflows (in the model's root, in the loss, in a module), gradients overflow, weights go non-finite.
Each takes a ``Ctx`` and returns an ``Outcome`` or None."""

from __future__ import annotations

from typing import Any

from ampdoctor.formats import FP16
from ampdoctor.input.batches import Batches, check_batch
from ampdoctor.judge import locate
from ampdoctor.judge.context import Ctx, amp_defeated, update_swallowed
from ampdoctor.judge.datascan import largest_beyond, typical_magnitudes
from ampdoctor.judge.detectors import custom_function_dtype, device_limited, loss_fault
from ampdoctor.judge.measures import first_bad_step, module_absmax, module_grad_absmax, outlier_field, probe_grad_problem
from ampdoctor.judge.opscan import NonfiniteOp, first_overflowing_op
from ampdoctor.records import Col, Finding, Fix, Outcome, StepStats, nonfinite
from ampdoctor.records import stats_at as _stats_at


def no_target(c: Ctx) -> Outcome | None:
    if c.tgt is not None:
        return None
    return Outcome("healthy", None, None, None, {"variant": "no_target"})


def custom_function(c: Ctx) -> Outcome | None:
    """The target raised a dtype error in the backward of a custom autograd.Function."""
    e = c.tgt.error if c.tgt is not None else None
    cfd = custom_function_dtype(e) if e is not None else None
    if e is None or cfd is None:
        return None
    dev = c.device.split(":")[0]
    facts = {"variant": "custom_function", "function": cfd.function, "module": cfd.module, "type": e.type,
             "message": e.message, "step": e.step, "device": dev}
    fix = Fix("custom_fwd_bwd", {"function": cfd.function, "device": dev})
    return Outcome("amp_misuse", cfd.module, e.step, c.tgt_name, facts,
                   [Finding("amp_misuse", "error", stage=c.tgt_name, module=cfd.module, step=e.step,
                            evidence={"error": f"{e.type}: {e.message}", "function": cfd.function})], [fix])


def target_raised(c: Ctx) -> Outcome | None:
    """The target raised: a kernel the device lacks (inconclusive) or code that breaks under the precision."""
    e = c.tgt.error if c.tgt is not None else None
    if e is None:
        return None
    device_limit = device_limited(e, c.tgt_name, c.device)
    cause = "inconclusive" if device_limit else "amp_misuse"
    facts = {"variant": "target_raised", "stage": c.tgt_name, "type": e.type, "message": e.message, "module": e.module,
             "step": e.step, "hint": e.hint, "device": c.device, "device_limit": device_limit}
    fix = Fix("device_limit", {"hint": e.hint}) if device_limit else \
        Fix("work_under_autocast", {"module": e.module, "type": e.type, "message": e.message})
    return Outcome(cause, e.module, e.step, c.tgt_name, facts,
                   [Finding(cause, "error", stage=c.tgt_name, module=e.module, step=e.step,
                            evidence={"error": f"{e.type}: {e.message}"})], [fix])


def outlier_at_event(c: Ctx) -> Outcome | None:
    """A target-stage event (the first fault, or a skip) falls on an outlier batch: the data."""
    if c.tgt is None:
        return None
    events = sorted(set(([c.bad] if c.bad is not None else []) + c.tgt.skipped_steps))
    for s in events:
        out = outlier_field(c.batches, s)
        if out is not None:
            field_, ratio, samples = out
            b = c.batches.index(s)
            facts = {"variant": "target_outlier", "stage": c.tgt_name, "step": s, "batch": b, "field": field_,
                     "ratio": ratio, "samples": samples}
            return Outcome("data", None, b, c.tgt_name, facts,
                           [Finding("data", "error", stage=c.tgt_name, step=b,
                                    evidence={"field": field_, "ratio_to_median": ratio, "samples": samples})],
                           [Fix("outlier_batch", {"batch": b, "field": field_, "samples": samples, "ratio": ratio})])
    return None


def beyond_range_batch(c: Ctx) -> Outcome | None:
    """A batch holds values the target format cannot represent (|x| >= 65520 for FP16) and they reach the model's
    modules: ``data``, whichever stage failed (raw FP16 turns them into inf; AMP may survive them when the op that
    reads them keeps FP32 input in FP32, a LayerNorm after ``inputs_embeds``, and then trains on them silently).

    "Reach": on the batch's step a module (not the root) reads an input that holds values beyond FP16's range in the
    FP32 stage (values are never cast there), while on no step whose batch is within range does one: the values come
    from the batch, not from the model. A model that masks or rescales them in its own code before any module (a
    sentinel replaced in FP32, raw units divided) is not named here; the data scan still reports them."""
    if c.tgt is None or c.tgt_name not in ("amp", "fp16"):
        return None
    limit = FP16.overflow_threshold
    big = {i for i in range(len(c.batches.items)) if _batch_absmax(c.batches, i) >= limit}
    over = [s for s in range(len(c.fp32.records)) if c.batches.index(s) in big]
    if not over:
        return None
    reached = {st.step: m for st in c.fp32.stats if (m := _reader_beyond_range(st)) is not None}
    if not reached or any(s not in over for s in reached):
        return None
    s = next((x for x in over if x in reached), None)
    if s is None:
        return None
    b = c.batches.index(s)
    where = largest_beyond(c.batches[s], limit)
    if where is None:
        return None
    field_, pos, value, count = where
    typical = typical_magnitudes(c.batches).get(field_, 0.0)
    probe_bad = first_bad_step(c.probe, amp=False) if c.probe is not None and c.probe is not c.tgt else None
    facts = {"variant": "beyond_range_batch", "stage": c.tgt_name, "step": s, "batch": b, "field": field_,
             "position": list(pos), "value": value, "count": count, "typical": typical,
             "ratio": abs(value) / typical if typical > 0 else None, "module": reached[s],
             "failed_step": c.bad, "probe_step": probe_bad, "steps": sorted(x for x in over if c.batches.index(x) == b)}
    ev = {"field": field_, "position": list(pos), "value": value, "count": count, "typical_magnitude": typical,
          "fp16_max": FP16.max, "first_reader": reached[s]}
    return Outcome("data", None, b, c.tgt_name, facts,
                   [Finding("data", "error", stage=c.tgt_name, step=b, evidence=ev)],
                   [Fix("beyond_range_batch", {"batch": b, "field": field_, "position": list(pos), "value": value})])


def _batch_absmax(batches: Batches, step: int) -> float:
    return max((fc.absmax for fc in check_batch(batches[step])), default=0.0)


def _reader_beyond_range(st: StepStats) -> str | None:
    """The first module (not the root) in execution order reading an input with values beyond FP16's range."""
    for call in st.calls:
        if call.module != locate.MODEL and any(t in st.act and st.act[t][Col.OVERFLOW] > 0 for t in call.inputs):
            return call.module
    return None


def damaged_weights(c: Ctx) -> Outcome | None:
    """amp: the weights reached at the bad step fail in FP32 too: AMP let damaged updates through."""
    rc = c.rc
    if c.bad is None or rc is None or rc.finite or c.tgt_name != "amp":
        return None
    return amp_defeated(c, c.bad, c.rc_ev, {"why": "damaged"})


def forward_in_root(c: Ctx) -> Outcome | None:
    """A forward fault made by the root's own code (outside every child module): name the op."""
    st = c.st
    if c.bad is None or st is None or not locate.forward_fault(st) or locate.locate_forward(st) != locate.MODEL:
        return None
    nop = c.rc.nonfinite_op() if c.rc is not None and c.rc.nonfinite_op is not None else None
    kind = "root" if nop is None else "loss" if nop.module is None else "model_loss" if nop.loss_only else "root"
    return _forward_in_code(c, kind, nop, c.rc_ev)


def loss_in_fp16(c: Ctx) -> Outcome | None:
    """Every module output is finite, yet the loss is not: the loss function made the NaN/Inf."""
    if c.bad is None or c.tgt is None:
        return None
    lf = loss_fault(c.tgt, c.bad, c.st)
    if lf is None:
        return None
    nop = c.rc.nonfinite_op() if c.rc is not None and c.rc.nonfinite_op is not None else None
    return _forward_in_code(c, "loss", nop, dict(c.rc_ev, loss=lf.loss))


def forward_overflow_fixes(module: str | None, device: str) -> list[Fix]:
    """What to change for a module whose output overflows FP16 in the forward (the verdict's fixes, and the
    lookback forecast's)."""
    return [Fix("keep_fp32", {"module": module, "device": device}), Fix("bf16_autocast"), Fix("into_range", {"module": module})]


def forward_overflow(c: Ctx) -> Outcome | None:
    """A module's output becomes non-finite in the target while FP32 stays finite."""
    st, bad = c.st, c.bad
    if bad is None or st is None or not locate.forward_fault(st):
        return None
    module = locate.locate_forward(st)
    if module is None and st.model_inputs and any(nonfinite(st.act[t]) > 0 for t in st.model_inputs if t in st.act):
        module = locate.first_consumer_of_inputs(st)
    ref = _stats_at(c.fp32, bad)
    ev = dict(c.rc_ev)
    rc = c.rc
    if rc is not None and rc.ops is not None and module is not None:
        op = first_overflowing_op(rc.ops(module))
        if op is not None:
            ev.update(op=op.op, op_overflow_frac=op.overflow_frac, fp32_absmax=op.absmax, fp16_max=FP16.max)
    if "fp32_absmax" not in ev and ref is not None and module is not None:
        amax = module_absmax(ref, module)
        if amax is not None:
            ev.update(fp32_absmax=amax, fp16_max=FP16.max)
    dev = c.device.split(":")[0]
    facts = {"variant": "forward_overflow", "stage": c.tgt_name, "module": module, "step": bad, "op": ev.get("op"),
             "fp32_absmax": ev.get("fp32_absmax"), "recheck_loss": rc.loss if rc is not None and rc.finite else None,
             "device": dev}
    fixes = forward_overflow_fixes(module, dev)
    return Outcome("fp16_forward_overflow", module, bad, c.tgt_name, facts,
                   [Finding("fp16_forward_overflow", "error", stage=c.tgt_name, module=module, step=bad, evidence=ev)], fixes)


def grad_overflow(c: Ctx) -> Outcome | None:
    """Gradients overflow in backward (or GradScaler's scale collapses / keeps skipping); for amp,
    when raw FP16 without scaling has no such problem, AMP itself is defeated."""
    st, bad, tgt, sd = c.st, c.bad, c.tgt, c.story
    if bad is None or tgt is None:
        return None
    if not ((st is not None and locate.backward_fault(st)) or c.collapsed or c.skip_alert):
        return None
    module = locate.locate_backward(st, _stats_at(c.fp32, bad)) if st is not None else None
    if c.tgt_name == "amp" and c.probe is not None and not probe_grad_problem(c.probe):
        # the gradients fit FP16 unscaled and overflow only times the scale: GradScaler's own business,
        # unless something handles the scaled gradients (the evidence amp_misuse names)
        if c.hooks:
            return amp_defeated(c, bad, c.rc_ev, {"why": "probe_clean"})
        if c.scaler_phase in ("calibration", "growth_probe", "backoff", "isolated") or not (c.collapsed or c.skip_alert):
            return _scaler_normal(c, bad, st, module)
    if module is None and c.probe is not None:
        pb = first_bad_step(c.probe, amp=False)
        ps = _stats_at(c.probe, pb) if pb is not None else None
        module = locate.locate_backward(ps) if ps is not None else None
    root_param = None
    if module == locate.MODEL:
        # the root's own code made it (a parameter of the root used in its forward, a loss computed there): no
        # child to name; the first offending computation is the root's, named by its parameter
        own = [p for p in locate.own_params(locate.MODEL, st.pgrad) if nonfinite(st.pgrad[p]) > 0] if st is not None else []
        root_param, module = (own[0] if own else None), None
    ev = dict(c.rc_ev)
    if sd is not None:
        ev.update(min_scale=sd.min_scale, skipped_steps=len(sd.skips), pattern=sd.pattern)
    ev["grad_l2_fp32_step"] = c.fp32.records[min(bad, len(c.fp32.records) - 1)].grad_l2_pre_clip
    how = "collapsed" if c.collapsed and sd else "skips" if c.later_skips else "nonfinite"
    facts = {"variant": "grad_overflow", "module": module, "step": bad, "how": how, "root_param": root_param,
             "min_scale": sd.min_scale if sd else None, "skips_after_calibration": len(c.later_skips)}
    dev = c.device.split(":")[0]
    fixes = ([Fix("keep_fp32_backward", {"module": module, "device": dev})] if module else []) + [Fix("reduce_loss"), Fix("bf16_no_overflow")]
    if sd is not None and sd.min_scale < 1:
        fixes.append(Fix("scale_below_one", {"min_scale": sd.min_scale}))
    return Outcome("fp16_grad_overflow", module, bad, c.tgt_name, facts,
                   [Finding("fp16_grad_overflow", "error", stage=c.tgt_name, module=module, step=bad, evidence=ev)], fixes)


def nonfinite_weights(c: Ctx) -> Outcome | None:
    """The weights become non-finite with finite gradients: FP16 weights swallow the updates
    (raw fp16 without master weights), else AMP is defeated."""
    st, bad, tgt = c.st, c.bad, c.tgt
    if bad is None or tgt is None:
        return None
    rec = tgt.records[bad] if bad < len(tgt.records) else tgt.records[-1]
    if rec.params_finite and not (st is not None and any(nonfinite(r) > 0 for r in st.param.values())):
        return None
    if c.plain_fp16_weights:
        return update_swallowed(c, bad)
    return amp_defeated(c, bad, c.rc_ev, {"why": "nonfinite_weights"})


def _scaler_normal(c: Ctx, step: int | None, st: StepStats | None, module: str | None) -> Outcome:
    """``healthy``: the step overflowed FP16 only times GradScaler's scale and the scaler backed off, as it
    is built to; what it did, the module that overflowed at that scale, and the headroom left unscaled."""
    rec = c.tgt.records[min(step or 0, len(c.tgt.records) - 1)] if c.tgt is not None and c.tgt.records else None
    scale = float(rec.scaler_scale) if rec is not None and rec.scaler_scale else None
    absmax = None
    if module is not None and c.probe is not None:
        ps = _stats_at(c.probe, min(step or 0, len(c.probe.records) - 1))
        if ps is not None:
            absmax = module_grad_absmax(ps, module)
    headroom = FP16.headroom_binades(absmax) if absmax else None
    facts = {"variant": "scaler_normal", "stage": "amp", "step": step, "module": module, "scale": scale,
             "phase": c.scaler_phase or "isolated", "absmax": absmax, "headroom": headroom}
    return Outcome("healthy", module, step, "amp", facts,
                   [Finding("scaler_normal", "info", stage="amp", module=module, step=step,
                            evidence={"scale": scale, "phase": facts["phase"], "grad_absmax_unscaled": absmax,
                                      "headroom_binades": headroom})], [])


def _forward_in_code(c: Ctx, kind: str, op: NonfiniteOp | None, rc_ev: dict[str, Any]) -> Outcome:
    """A forward fault made by code outside every child module: the loss function ('loss'), a loss
    the model computes in its own forward ('model_loss'), or other code of the root ('root')."""
    stage, step = c.tgt_name, c.bad
    ev = dict(rc_ev)
    module = op.module if op is not None and op.module not in (None, locate.MODEL) else None
    if op is not None:
        ev.update(op=op.op, op_line=op.line, op_in=kind)  # (a code: report.words names the place)
    dev = c.device.split(":")[0]
    place = "root" if kind == "root" and module is None else "module" if kind == "root" else kind
    facts = {"variant": "forward_in_code", "place": place, "kind": kind, "op": op.op if op else None,
             "op_line": op.line if op else None,
             "module": module, "stage": stage, "step": step, "device": dev,
             "recheck_finite": bool(rc_ev.get("fp32_recheck_finite"))}
    op_facts = {"op": facts["op"], "op_line": facts["op_line"], "device": dev}
    first = (Fix("op_fp32", op_facts) if place == "root" else
             Fix("keep_fp32_forward", {"module": module, "device": dev}) if place == "module" else Fix("loss_fp32", {"device": dev}))
    return Outcome("fp16_forward_overflow", module, step, stage, facts,
                   [Finding("fp16_forward_overflow", "error", stage=stage, module=module, step=step, evidence=ev)],
                   [first, Fix("bf16_target")])
