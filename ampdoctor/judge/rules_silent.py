"""The rules of the last group (``rules.RULES``): overflows that something hid from GradScaler, then the silent
failures: the loss stalls, optimizer constants underflow, parameters freeze, gradients flush to zero in FP16.
Each takes a ``Ctx`` and returns an ``Outcome`` or None."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ampdoctor.fmt import pow2
from ampdoctor.formats import FP16
from ampdoctor.judge import locate
from ampdoctor.judge.context import Ctx, amp_defeated, update_swallowed
from ampdoctor.judge.detectors import frozen_params
from ampdoctor.judge.measures import first_flushed_module, hit_modules, masked_overflows, mean_swallowed, underflowing_params
from ampdoctor.records import Col, Finding, Fix, Outcome, nonfinite


def masked_overflow(c: Ctx) -> Outcome | None:
    """amp: a scaled gradient must overflow FP16, yet arrived at unscale_ as finite zeros."""
    if c.tgt_name != "amp" or c.tgt is None:
        return None
    masked = masked_overflows(c.tgt, c.fp32)
    if not masked:
        return None
    p, step, scaled = masked[0]
    ev = {"parameter": p, "fp32_grad_absmax_x_scale": scaled, "fp16_max": FP16.max, "progress_vs_fp32": c.ratio}
    return amp_defeated(c, step, ev, {"why": "masked", "parameter": p, "scaled": scaled})


def stall(c: Ctx) -> Outcome | None:
    """The target makes under half of FP32's loss progress without any non-finite value."""
    tgt = c.tgt
    if tgt is None or not c.stalled:
        return None
    if c.plain_fp16_weights and (tgt.optimizer_underflow or mean_swallowed(tgt) > 0.5):
        return update_swallowed(c, None)
    if c.uf:
        return _underflow(c, c.uf)
    if c.tgt_name == "amp":
        return amp_defeated(c, None, {"progress_vs_fp32": c.ratio}, {"why": "stall"})
    facts = {"variant": "stall", "stage": c.tgt_name, "ratio": c.ratio}
    return Outcome("fp16_grad_underflow", None, None, c.tgt_name, facts,
                   [Finding("fp16_grad_underflow", "error", stage=c.tgt_name, evidence={"progress_vs_fp32": c.ratio})])


def optimizer_underflow(c: Ctx) -> Outcome | None:
    """FP16 weights and optimizer state with an optimizer constant that rounds to 0 in FP16."""
    if c.plain_fp16_weights and c.tgt is not None and c.tgt.optimizer_underflow:
        return update_swallowed(c, None)
    return None


def frozen(c: Ctx) -> Outcome | None:
    """Parameters frozen by underflow while the loss still falls: the underflow verdict, per parameter."""
    if c.tgt is None:
        return None
    fz = frozen_params(c.tgt, c.fp32, c.uf, underflowing_params(c.tgt, c.fp32, steps=len(c.tgt.stats))
                       if c.tgt.weight_decay else None)
    if not fz:
        return None
    out = _underflow(c, [(f.param, f.flushed) for f in fz])
    f0 = fz[0]
    out.findings[0].evidence["weight_movement_vs_fp32"] = {f.param: round(f.moved, 4) for f in fz[:10]}
    out.facts.update(variant="frozen", frozen=len(fz), moved=f0.moved, steps=len(c.tgt.records), decayed=f0.decayed,
                     weight_decay=c.tgt.weight_decay.get(f0.param))
    # the module named is the first backward reaches with more than half of its own parameter gradients flushed
    # (c.uf is in backward order), frozen or not: upstream of it every gradient has passed through it
    first, frac = c.uf[0] if c.uf else (f0.param, f0.flushed)
    lead = first.rsplit(".", 1)[0] if "." in first else locate.MODEL
    if lead != out.module:
        out.facts.update(module=lead, first_flushed=first, first_flushed_frac=frac)
        out.findings[0].module = lead
        for fx in out.fixes:
            if "module" in fx.facts:
                fx.facts["module"] = lead
        out = replace(out, module=lead)
    return out


def flushed_in_fp16(c: Ctx) -> Outcome | None:
    """Pure FP16 (no loss scaling): at some step a module's own parameter gradients are more than half flushed to
    zero while non-zero in FP32 on the same step. Without a scaler nothing brings them back: those updates are lost,
    also when the rest of the model trains and the loss keeps pace (a branch behind a 1e-6 LayerScale)."""
    tgt = c.tgt
    if c.tgt_name != "fp16" or tgt is None:
        return None
    hit = first_flushed_module(tgt, c.fp32)
    if hit is None:
        return None
    step, module, share, params = hit
    out = _underflow(c, params)
    out.facts.update(variant="flushed_step", step=step, module=module, share=share, modules=hit_modules(tgt, c.fp32, step))
    out.findings[0].step = step
    out.findings[0].module = module
    out.findings[0].evidence.update(step=step, module_flushed_share=share)
    return replace(out, module=module, step=step)


def _underflow(c: Ctx, uf: list[tuple[str, float]]) -> Outcome:
    """Gradients flush to zero in the target and the loss stalls (or the weights freeze)."""
    stage, ratio, story = c.tgt_name, c.ratio, c.story
    param, frac = uf[0]
    module = param.rsplit(".", 1)[0] if "." in param else locate.MODEL
    ev: dict[str, Any] = {"flushed": {p: round(f, 4) for p, f in uf[:10]}, "progress_vs_fp32": ratio}
    gmax = max((float(r[Col.ABSMAX]) for st in c.fp32.stats for r in st.pgrad.values() if nonfinite(r) == 0), default=0.0)
    fixes: list[Fix]
    if stage == "amp":
        if gmax > 0:
            # the largest power-of-two scale that keeps the largest gradient one binade below FP16's max
            k = math.floor(math.log2(FP16.max / gmax)) - 1
            ev["largest_fp32_grad"] = gmax
            ev["largest_safe_scale"] = pow2(2.0**k, "**")
            used = story.max_scale if story else 65536.0
            if 2.0**k > used:
                fixes = [Fix("raise_init_scale", {"largest_grad": gmax, "exponent": k,
                                                  "growth_steps": int(math.log2(2.0**k / used)) * c.cfg.growth_interval})]
            else:
                fixes = [Fix("no_single_scale", {"module": module})]
        else:
            fixes = [Fix("module_fp32", {"module": module})]
    else:
        fixes = [Fix("use_loss_scaling"), Fix("gradscaler_explained")]
    facts = {"variant": "underflow", "stage": stage, "param": param, "flushed": frac, "ratio": ratio,
             "module": module, "parameters": len(uf)}
    return Outcome("fp16_grad_underflow", module, None, stage, facts,
                   [Finding("fp16_grad_underflow", "error", stage=stage, module=module, evidence=ev)], fixes)
