"""From stage results to a verdict, findings and fixes. No I/O; the FP32 re-check is injected."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ampdoctor.formats import FP16
from ampdoctor.input.batches import Batches, check_batch, outlier_ratio
from ampdoctor.input.config import TriageConfig
from ampdoctor.judge import locate
from ampdoctor.judge.datascan import DataIssue, scan_batches
from ampdoctor.judge.opscan import NonfiniteOp, OpRecord, first_overflowing_op
from ampdoctor.judge.progress import describe, loss_window
from ampdoctor.judge.rules_extra import Frozen, custom_function_dtype, frozen_params, loss_fault, probe_on_flagged_batch
from ampdoctor.judge.scaler import diagnose_scale
from ampdoctor.records import Col, Finding, LayerRow, ScaleEvent, ScalerStory, StageResult, StepStats, Verdict, nonfinite

OUTLIER_RATIO = 1e3
"""A batch whose largest value is 1000x the median batch's is an outlier (orders of magnitude)."""
FLUSH_THRESHOLD = 0.5
"""A parameter whose FP32-non-zero gradient elements are more than half zero in FP16 underflows."""
STALL_RATIO = 0.5
"""The target stalls when it makes less than half of FP32's loss progress."""
SKIP_RATE_ALERT = 0.05
"""Skip rate after calibration above which GradScaler is failing (the seed articles' 5% alert)."""


@dataclass
class Recheck:
    """An FP32 replay of one step's batch from given weights."""

    loss: float
    finite: bool
    weights: str
    """'initial' or 'stage <name> before step <k>'."""
    ops: Callable[[str], list[OpRecord]] | None = None
    """Replays the same FP32 forward and lists the ops run inside a named module."""
    nonfinite_op: Callable[[], NonfiniteOp | None] | None = None
    """Replays the step's forward and loss in the stage's own precision (autocast / .half()) from the
    same weights and returns the first op that turns finite inputs into a non-finite output."""


RecheckFn = Callable[[str, int], Recheck | None]


@dataclass
class Diagnosis:
    verdict: Verdict
    findings: list[Finding]
    layers: list[LayerRow]
    scaler: ScalerStory | None
    fixes: list[str]


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


MIN_STALL_STEPS = 8
"""Fewer steps than this are too few to call a stall (per-batch noise dominates)."""


def stall_ratio(target: StageResult, fp32: StageResult) -> float | None:
    """How much of FP32's loss progress the target makes over the same steps (1: as much, 0: none).

    Both stages start from the same weights and see the same batch at every step, so the
    comparison is step by step: ``(head32 - tail_t) / (head32 - tail32)``, where head is the mean
    loss over the first quarter of the steps and tail over the last quarter (means over a window
    damp the batch-to-batch noise). None when FP32 made no meaningful progress (under 1% of its
    head) or there are too few steps to tell.
    """
    n = min(len(target.records), len(fp32.records))
    if n < MIN_STALL_STEPS:
        return None
    ref = [r.loss for r in fp32.records[:n]]
    tgt = [r.loss for r in target.records[:n]]
    if not all(math.isfinite(v) for v in ref):
        return None
    k = max(2, n // 4)
    head32 = float(np.mean(ref[:k]))
    d32 = head32 - float(np.mean(ref[-k:]))
    if head32 == 0 or d32 <= 1e-2 * abs(head32):
        return None
    tail_t = float(np.mean(tgt[-k:]))
    return (head32 - tail_t) / d32 if math.isfinite(tail_t) else 0.0


def _stats_at(res: StageResult, step: int) -> StepStats | None:
    for s in res.stats:
        if s.step == step:
            return s
    return None


def underflowing_params(target: StageResult, fp32: StageResult, steps: int = 5) -> list[tuple[str, float]]:
    """(param, median flushed share) for params above FLUSH_THRESHOLD, in backward order."""
    fr: dict[str, list[float]] = {}
    for st, ref in zip(target.stats[:steps], fp32.stats[:steps], strict=False):
        for p, row in st.pgrad.items():
            r = ref.pgrad.get(p)
            if r is None or nonfinite(row) > 0 or nonfinite(r) > 0:
                continue
            fr.setdefault(p, []).append(locate.flushed_frac(row, r))
    out = [(p, float(np.median(v))) for p, v in fr.items() if v and np.median(v) > FLUSH_THRESHOLD]
    if out and target.stats:
        order = locate.backward_order(target.stats[0])
        rank = {m: i for i, m in enumerate(order)}
        out.sort(key=lambda pv: rank.get(pv[0].rsplit(".", 1)[0], 1 << 30))
    return out


def masked_overflows(target: StageResult, fp32: StageResult, steps: int = 5) -> list[tuple[str, int, float]]:
    """(param, step, fp32 absmax x scale) where AMP applied a finite gradient that is mostly zero
    although FP32's gradient times the loss scale exceeds FP16's range.

    In FP16 arithmetic such a scaled gradient must become inf, which GradScaler would see and skip;
    a finite zero instead means something between backward and unscale_ replaced the overflow.
    """
    out = []
    for rec, st, ref in zip(target.records[:steps], target.stats[:steps], fp32.stats[:steps], strict=False):
        if rec.skipped or rec.scaler_scale is None:
            continue
        for p, row in st.pgrad.items():
            r = ref.pgrad.get(p)
            if r is None or nonfinite(row) > 0 or nonfinite(r) > 0:
                continue
            scaled = float(r[Col.ABSMAX]) * rec.scaler_scale
            if scaled >= FP16.overflow_threshold and locate.flushed_frac(row, r) > FLUSH_THRESHOLD:
                out.append((p, rec.step, scaled))
    return out


def _first_bad_step(res: StageResult, amp: bool) -> int | None:
    """First step with a fault: non-finite loss or weights, forward fault, or (plain stages) grads."""
    for r, st in zip(res.records, res.stats, strict=False):
        if not math.isfinite(r.loss) or not r.params_finite or locate.forward_fault(st):
            return r.step
        if not amp and not math.isfinite(r.grad_l2_pre_clip):
            return r.step
    return None


def _hooks_in(model_hooks: list[str]) -> str:
    return ", ".join(model_hooks[:5])


def layer_table(results: dict[str, StageResult], target: str, limit: int = 12, focus: str | None = None) -> list[LayerRow]:
    """Per module: FP32 absmax and FP16 overflow share of its output, flushed share of its
    parameter gradients, non-finite share in the target stage."""
    fp32, tgt = results.get("fp32"), results.get(target)
    if fp32 is None or not fp32.stats:
        return []
    rows: dict[tuple[str, str], LayerRow] = {}

    def row(module: str, kind: str) -> LayerRow:
        key = (module, kind)
        if key not in rows:
            rows[key] = LayerRow(module, kind, 0.0, 0.0, 0.0, 0.0, math.inf)
        return rows[key]

    for st in fp32.stats:
        for c in st.calls:
            for t in c.outputs:
                r = st.act.get(t)
                if r is None or r[Col.NUMEL] == 0:
                    continue
                lr = row(c.module, "activation")
                lr.absmax_fp32 = max(lr.absmax_fp32, float(r[Col.ABSMAX]))
                lr.overflow_frac = max(lr.overflow_frac, float(r[Col.OVERFLOW] / r[Col.NUMEL]))
                g = st.grad.get(t)
                if g is not None and g[Col.NUMEL]:
                    gr = row(c.module, "grad")
                    gr.absmax_fp32 = max(gr.absmax_fp32, float(g[Col.ABSMAX]))
                    gr.overflow_frac = max(gr.overflow_frac, float(g[Col.OVERFLOW] / g[Col.NUMEL]))
        for p, r in st.pgrad.items():
            if r[Col.NUMEL]:
                pr = row(p, "param_grad")
                pr.absmax_fp32 = max(pr.absmax_fp32, float(r[Col.ABSMAX]))
                pr.overflow_frac = max(pr.overflow_frac, float(r[Col.OVERFLOW] / r[Col.NUMEL]))
    if tgt is not None:
        calib = set(_calibration_steps(tgt)) if target == "amp" else set()
        for st in tgt.stats:
            for c in st.calls:
                for t in c.outputs:
                    r = st.act.get(t)
                    if r is not None and r[Col.NUMEL] and (c.module, "activation") in rows:
                        lr = rows[(c.module, "activation")]
                        frac = nonfinite(r) / r[Col.NUMEL]
                        if frac > 0 and lr.first_nonfinite_step is None:
                            lr.first_nonfinite_step = st.step
                        lr.nonfinite_frac = max(lr.nonfinite_frac, frac)
            for p, r in st.pgrad.items():
                if st.step in calib:  # GradScaler's calibration skips are expected to hold inf gradients
                    break
                if r[Col.NUMEL] and (p, "param_grad") in rows:
                    pr = rows[(p, "param_grad")]
                    frac = nonfinite(r) / r[Col.NUMEL]
                    if frac > 0 and pr.first_nonfinite_step is None:
                        pr.first_nonfinite_step = st.step
                    pr.nonfinite_frac = max(pr.nonfinite_frac, frac)
        for p, f in underflowing_params(tgt, fp32, steps=len(tgt.stats)):
            if (p, "param_grad") in rows:
                rows[(p, "param_grad")].underflow_frac = f
    for lrow in rows.values():
        lrow.headroom_binades = FP16.headroom_binades(lrow.absmax_fp32)
    # keep the interesting rows: non-finite, overflow, flushed, or thin headroom
    def score(r: LayerRow) -> tuple[float, ...]:
        return (r.nonfinite_frac > 0, r.overflow_frac, r.underflow_frac, -r.headroom_binades)
    interesting = [r for r in rows.values() if r.nonfinite_frac > 0 or r.overflow_frac > 0
                   or r.underflow_frac > 0 or r.headroom_binades < 2]
    # leaf-most modules first: a container only repeats its last child's output
    names = locate.innermost(r.module for r in interesting if r.kind == "activation")
    interesting = [r for r in interesting if r.kind != "activation" or r.module in names]
    interesting.sort(key=score, reverse=True)
    if focus is not None:  # the verdict's module always leads the table
        lead = [r for r in rows.values() if r.module == focus and r.kind == "activation"]
        interesting = lead + [r for r in interesting if r not in lead]
    return interesting[:limit]


def scaler_story(res: StageResult, cfg: TriageConfig) -> ScalerStory | None:
    recs = res.records
    if not recs or recs[0].scaler_scale is None:
        return None
    scales = [float(r.scaler_scale or 0.0) for r in recs]
    skipped = [r.skipped for r in recs]
    d = diagnose_scale(scales, skipped, growth_interval=cfg.growth_interval,
                       backoff_factor=cfg.backoff_factor, init_scale=cfg.init_scale)
    events = [ScaleEvent(r.step, float(r.scaler_scale or 0.0), r.skip_reason) for r in recs if r.skipped]
    return ScalerStory(cfg.init_scale, d.final_scale, d.min_scale, max(scales), d.calibration_skips, events,
                       d.pattern, d.explanation + (". " + "; ".join(d.recommendations) if d.recommendations else ""))


def diagnose(
    results: dict[str, StageResult],
    batches: Batches,
    cfg: TriageConfig,
    recheck: RecheckFn,
    device: str = "cpu",
    model_hooks: list[str] | None = None,
) -> Diagnosis:
    """Apply the rules in order: FP32 → target stage (with probes and the FP32 re-check) → healthy."""
    findings: list[Finding] = []
    fixes: list[str] = []
    fp32 = results["fp32"]
    target = cfg.target
    tgt_name = "amp" if target == "amp" else target
    tgt = results.get(tgt_name)
    layers = layer_table(results, tgt_name)
    story = scaler_story(results["amp"], cfg) if "amp" in results else None
    hooks = model_hooks or []
    data_issues = scan_batches(batches)  # always: findings whatever the verdict

    def verdict(cause: str, module: str | None, step: int | None, stage: str | None, summary: str) -> Diagnosis:
        table = layer_table(results, tgt_name, focus=module) if module else layers
        ev = findings[0].evidence if findings else {}
        if module and "op" in ev and "fp32_absmax" in ev:
            op_row = LayerRow(f"{module} > {ev['op']}", "op", float(ev["fp32_absmax"]), float(ev.get("op_overflow_frac", 0.0)),
                              0.0, 0.0, FP16.headroom_binades(float(ev["fp32_absmax"])), step)
            table = [op_row, *table]
        if cause == "amp_misuse" and story is not None and not story.skips:
            # the history looks healthy only because the overflows never reached GradScaler
            story.explanation = ("the scale never backed off, but not because the gradients fit: the overflows were "
                                 "hidden from GradScaler before unscale_ (see the verdict)")
        if cause.startswith("fp16_") and "bf16" in results and target != "bf16":
            fixes.append(_bf16_check(results["bf16"], fp32))
        findings.extend(_data_findings(data_issues, findings, results, batches))
        return Diagnosis(Verdict(cause, module, step, stage, summary, device), findings, table, story, fixes)

    # 1. FP32 itself fails: data or a model bug ---------------------------------------------------
    if fp32.error is not None:
        e = fp32.error
        findings.append(Finding("model_bug", "error", f"fp32 stage raised {e.type} at step {e.step}", "fp32",
                                e.module, e.step, {"message": e.message}, "Fix the exception; it is not a precision issue."))
        fixes.append(f"Fix the {e.type} raised in {e.module or 'your code'} at step {e.step}: {e.message}")
        return verdict("model_bug", e.module, e.step, "fp32",
                       f"The FP32 reference raises {e.type} at step {e.step}: {e.message}")
    s32 = _first_bad_step(fp32, amp=False)
    if s32 is not None:
        return _fp32_failure(fp32, s32, batches, recheck, findings, fixes, verdict)

    # 2. the target stage ------------------------------------------------------------------------
    if tgt is None:
        return verdict("healthy", None, None, None, "FP32 trains cleanly; no target stage was run.")
    if tgt.error is not None:
        e = tgt.error
        cfd = custom_function_dtype(e)
        if cfd is not None:
            dev = device.split(":")[0]
            fix = (f"Decorate {cfd.function}.forward with `@torch.amp.custom_fwd(device_type='{dev}', cast_inputs=torch.float32)` "
                   f"and {cfd.function}.backward with `@torch.amp.custom_bwd(device_type='{dev}')`: forward then runs in FP32 "
                   "with autocast off, and backward gets the same dtypes forward saw.")
            where = f"{cfd.module}'s custom autograd.Function {cfd.function}" if cfd.module else f"custom autograd.Function {cfd.function}"
            findings.append(Finding("amp_misuse", "error", f"{where} raises {e.type} in backward under autocast", tgt_name,
                                    cfd.module, e.step, {"error": f"{e.type}: {e.message}", "function": cfd.function}, fix))
            fixes.append(fix)
            return verdict("amp_misuse", cfd.module, e.step, tgt_name,
                           f"The backward of {where} raises {e.type} at step {e.step} ({e.message[:120]}): under autocast it "
                           "receives FP16 tensors next to FP32 ones, because the Function has no custom_fwd/custom_bwd.")
        device_limit = "device limitation" in e.hint
        cause = "inconclusive" if device_limit else "amp_misuse"
        findings.append(Finding(cause, "error", f"{tgt_name} stage raised {e.type} in {e.module or 'user code'} at step {e.step}",
                                tgt_name, e.module, e.step, {"error": f"{e.type}: {e.message}"}, e.hint))
        fixes.append(e.hint if device_limit else
                     f"Make {e.module or 'the model'} work under autocast: it raised {e.type}: {e.message}")
        what = "cannot run" if device_limit else "breaks"
        return verdict(cause, e.module, e.step, tgt_name,
                       f"The {tgt_name} configuration {what} on {device}: {e.type} in {e.module or 'user code'} "
                       f"at step {e.step} ({e.message[:120]}). {e.hint}")

    probe = results.get("fp16")
    ratio = stall_ratio(tgt, fp32)
    stalled = ratio is not None and ratio < STALL_RATIO
    sd = story
    collapsed = sd is not None and sd.pattern == "collapsed"
    calib_steps = set(_calibration_steps(tgt)) if tgt_name == "amp" else set()
    later_skips = [s for s in tgt.skipped_steps if s not in calib_steps] if sd else []
    skip_alert = bool(later_skips) and len(later_skips) / max(1, len(tgt.records)) > SKIP_RATE_ALERT
    bad = _first_bad_step(tgt, amp=tgt_name == "amp")
    if tgt_name == "amp" and bad is None and (collapsed or skip_alert):
        bad = later_skips[0] if later_skips else (tgt.skipped_steps[0] if tgt.skipped_steps else None)

    # data outliers at any target-stage event (skip or fault)
    events = sorted(set(([bad] if bad is not None else []) + tgt.skipped_steps))
    for s in events:
        out = _outlier(batches, s)
        if out is not None:
            field_, ratio_o, samples = out
            b = batches.index(s)
            findings.append(Finding("data", "error", f"batch {b} is an outlier: {field_} is {ratio_o:.3g}x the median batch",
                                    tgt_name, None, b, {"field": field_, "ratio_to_median": ratio_o, "samples": samples},
                                    f"Fix batch {b} ({field_}, samples {samples[:10]}): normalise or drop it in build_dataloader()."))
            fixes.append(f"Fix batch {b}: {field_} samples {samples[:10]} are {ratio_o:.3g}x larger than a typical batch")
            return verdict("data", None, b, tgt_name,
                           f"Step {s} of the {tgt_name} stage fails on batch {b}, whose field {field_!r} is {ratio_o:.3g}x larger "
                           "than the median batch: the failure follows the data.")

    if bad is not None:
        st = _stats_at(tgt, bad)
        rc = recheck(tgt_name, bad)
        rc_ev = {"fp32_recheck_loss": rc.loss, "fp32_recheck_finite": rc.finite, "fp32_recheck_weights": rc.weights} if rc else {}
        rec = tgt.records[bad] if bad < len(tgt.records) else tgt.records[-1]
        if rc is not None and not rc.finite:
            # the weights were already damaged: not a range problem at this step
            if tgt_name == "amp":
                return _amp_misuse(tgt, fp32, probe, bad, hooks, rc_ev, findings, fixes, verdict,
                                   "weights reached at this step fail in FP32 too: AMP let damaged updates through")
        if st is not None and locate.forward_fault(st) and locate.locate_forward(st) == locate.MODEL:
            # the root's own code made it: never answer <model>; name the op (a loss inside forward is the loss)
            nop = rc.nonfinite_op() if rc is not None and rc.nonfinite_op is not None else None
            kind = "root" if nop is None else "loss" if nop.module is None else "model_loss" if nop.loss_only else "root"
            return _forward_in_code(kind, nop,
                                    tgt_name, bad, rc_ev, device, findings, fixes, verdict)
        lf = loss_fault(tgt, bad, st)
        if lf is not None:
            nop = rc.nonfinite_op() if rc is not None and rc.nonfinite_op is not None else None
            return _forward_in_code("loss", nop, tgt_name, bad, dict(rc_ev, loss=lf.loss), device, findings, fixes, verdict)
        if st is not None and locate.forward_fault(st):
            module = locate.locate_forward(st)
            if module is None and st.model_inputs and any(nonfinite(st.act[t]) > 0 for t in st.model_inputs if t in st.act):
                module = locate.first_consumer_of_inputs(st)
            ref = _stats_at(fp32, bad)
            ev = dict(rc_ev)
            if rc is not None and rc.ops is not None and module is not None:
                op = first_overflowing_op(rc.ops(module))
                if op is not None:
                    ev["op"] = op.op
                    ev["op_overflow_frac"] = op.overflow_frac
                    ev["fp32_absmax"] = op.absmax
                    ev["fp16_max"] = FP16.max
            if "fp32_absmax" not in ev and ref is not None and module is not None:
                amax = _module_absmax(ref, module)
                if amax is not None:
                    ev["fp32_absmax"] = amax
                    ev["fp16_max"] = FP16.max
            findings.append(Finding("fp16_forward_overflow", "error",
                                    f"{module or 'the input'} overflows FP16 in the forward pass", tgt_name, module, bad, ev,
                                    _fix_forward(module, device)))
            fixes.extend(_fixes_forward(module, device, ev))
            op_s = f"its {ev['op']} op " if "op" in ev else ""
            amax_s = (f" ({op_s}reaches {_fmt(float(ev['fp32_absmax']))} in FP32, above FP16's max {FP16.max:g})"  # type: ignore[arg-type]
                      if "fp32_absmax" in ev and float(ev["fp32_absmax"]) > FP16.max else "")  # type: ignore[arg-type]
            return verdict("fp16_forward_overflow", module, bad, tgt_name,
                           f"In the {tgt_name} stage the output of {module or 'the input cast'} becomes non-finite at step "
                           f"{bad}{amax_s} while FP32 stays finite" + (" (FP32 re-check of that step from the same weights: "
                           f"loss {_fmt(rc.loss)})" if rc and rc.finite else "") + ".")
        grads_bad = st is not None and locate.backward_fault(st)
        if grads_bad or collapsed or skip_alert:
            if tgt_name == "amp" and probe is not None and not _probe_grad_problem(probe):
                return _amp_misuse(tgt, fp32, probe, bad, hooks, rc_ev, findings, fixes, verdict,
                                   "GradScaler keeps skipping while raw FP16 gradients (no scaling) stay finite")
            module = locate.locate_backward(st) if st is not None else None
            if module is None and probe is not None:
                pb = _first_bad_step(probe, amp=False)
                ps = _stats_at(probe, pb) if pb is not None else None
                module = locate.locate_backward(ps) if ps is not None else None
            ev = dict(rc_ev)
            if sd is not None:
                ev.update(min_scale=sd.min_scale, skipped_steps=len(sd.skips), pattern=sd.pattern)
            ev["grad_l2_fp32_step"] = fp32.records[min(bad, len(fp32.records) - 1)].grad_l2_pre_clip
            findings.append(Finding("fp16_grad_overflow", "error", f"gradients overflow FP16 in backward ({module or 'at the loss'})",
                                    tgt_name, module, bad, ev, _fix_grad_overflow(module, sd)))
            fixes.extend(_fixes_grad_overflow(module, sd, fp32, device))
            how = (f"GradScaler's scale collapsed to {_fmt(sd.min_scale)}" if collapsed and sd else
                   f"{len(later_skips)} steps skipped after calibration" if later_skips else "gradients became non-finite")
            return verdict("fp16_grad_overflow", module, bad, tgt_name,
                           f"The forward pass is finite but gradients overflow FP16 in backward at step {bad} "
                           f"(first at {module or 'the loss'}); {how}.")
        if not rec.params_finite or (st is not None and any(nonfinite(r) > 0 for r in st.param.values())):
            if tgt_name == "fp16" and not tgt.master_weights:
                return _swallowed(tgt, fp32, bad, findings, fixes, verdict, probe)
            return _amp_misuse(tgt, fp32, probe, bad, hooks, rc_ev, findings, fixes, verdict,
                               "weights became non-finite with finite gradients")

    # 3. overflows that something hid from GradScaler, then silent stalls -------------------------
    if tgt_name == "amp":
        masked = masked_overflows(tgt, fp32)
        if masked:
            p, step, scaled = masked[0]
            ev_m: dict[str, object] = {"parameter": p, "fp32_grad_absmax_x_scale": scaled, "fp16_max": FP16.max,
                                       "progress_vs_fp32": ratio}
            return _amp_misuse(tgt, fp32, probe, step, hooks, ev_m, findings, fixes, verdict,
                               f"{p}'s gradient times the loss scale is {scaled:.3g}, beyond FP16's max, so it must "
                               "overflow, yet it arrived at unscale_ as finite zeros: something replaced the infs, "
                               "GradScaler never backed off and those gradients were dropped")
    uf = underflowing_params(tgt, fp32)
    if stalled or (tgt_name == "fp16" and not tgt.master_weights and tgt.optimizer_underflow and stalled):
        if tgt_name == "fp16" and not tgt.master_weights and (tgt.optimizer_underflow or _mean_swallowed(tgt) > 0.5):
            return _swallowed(tgt, fp32, None, findings, fixes, verdict, probe)
        if uf:
            return _underflow(tgt_name, uf, ratio, findings, fixes, verdict, story, fp32)
        if tgt_name == "amp":
            return _amp_misuse(tgt, fp32, probe, None, hooks, {"progress_vs_fp32": ratio}, findings, fixes, verdict,
                               "AMP's loss stalls against FP32 while raw FP16 shows no range problem")
        findings.append(Finding("fp16_grad_underflow", "error", "training stalls against FP32", tgt_name, None, None,
                                {"progress_vs_fp32": ratio}, "Use GradScaler (autocast + loss scaling) or bf16."))
        return verdict("fp16_grad_underflow", None, None, tgt_name,
                       f"The {tgt_name} stage makes {ratio:.0%} of FP32's loss progress without any non-finite value.")
    if tgt_name == "fp16" and not tgt.master_weights and tgt.optimizer_underflow:
        return _swallowed(tgt, fp32, None, findings, fixes, verdict, probe)
    frozen = frozen_params(tgt, fp32, uf)
    if frozen:
        return _frozen(tgt_name, frozen, uf, ratio, len(tgt.records), findings, fixes, verdict, story, fp32)

    # 4. healthy, with warnings from the probes ---------------------------------------------------
    _warnings(results, tgt_name, fp32, story, uf, findings, fixes)
    summary = f"The {tgt_name} configuration trains like FP32"
    window = loss_window(tgt, fp32, MIN_STALL_STEPS)
    if ratio is not None and window is not None:
        summary += f" ({describe(window, tgt_name)})"
    summary += "; no non-finite values reached the weights."
    if story and story.calibration_skips:
        summary += f" {story.calibration_skips} GradScaler skip(s) while the scale calibrated are normal."
    return verdict("healthy", None, None, tgt_name, summary)


def _bf16_check(bf16: StageResult, fp32: StageResult) -> str:
    """What the bf16 stage of this very run says about switching to bf16."""
    if bf16.error is not None:
        return f"bf16 was tried in this run and raised {bf16.error.type} at step {bf16.error.step}: {bf16.error.message[:120]}"
    bad = _first_bad_step(bf16, amp=False)
    if bad is not None:
        return f"bf16 was tried in this run and also goes non-finite (step {bad}): the range is not the only problem."
    ratio = stall_ratio(bf16, fp32)
    how = f", {ratio:.0%} of FP32's loss progress" if ratio is not None else ""
    return f"bf16 was tried in this run: no non-finite values in {len(bf16.records)} steps{how}. Switching to bf16 autocast fixes this."


def _calibration_steps(res: StageResult) -> list[int]:
    """Skipped steps that brought GradScaler's scale to a new low (see scaler.diagnose_scale)."""
    scales = [float(r.scaler_scale or 0.0) for r in res.records]
    return [i for i, r in enumerate(res.records) if r.skipped and (i == 0 or scales[i] <= min(scales[:i]))]


def _outlier(batches: Batches, step: int) -> tuple[str, float, list[int]] | None:
    b = batches[step]
    for fc in check_batch(b):
        r, samples = outlier_ratio(batches, fc.field, batches.index(step))
        if r >= OUTLIER_RATIO:
            return fc.field, r, samples
    return None


def _module_absmax(st: StepStats, module: str) -> float | None:
    vals = [float(st.act[t][Col.ABSMAX]) for c in st.calls if c.module == module for t in c.outputs if t in st.act]
    return max(vals) if vals else None


def _probe_grad_problem(probe: StageResult) -> bool:
    """Raw FP16 shows non-finite values in forward or backward (without a scaler hiding them)."""
    for r, st in zip(probe.records, probe.stats, strict=False):
        if not math.isfinite(r.loss) or not math.isfinite(r.grad_l2_pre_clip) or locate.backward_fault(st) or locate.forward_fault(st):
            return True
    return probe.error is not None


def _mean_swallowed(res: StageResult) -> float:
    v = [r.update_swallowed_frac for r in res.records if r.update_swallowed_frac is not None]
    return float(np.mean(v)) if v else 0.0


def _fp32_failure(fp32: StageResult, s: int, batches: Batches, recheck: RecheckFn, findings: list[Finding],
                  fixes: list[str], verdict: Callable[..., Diagnosis]) -> Diagnosis:
    b = batches.index(s)
    bad_fields = [fc for fc in check_batch(batches[s]) if fc.nonfinite]
    if bad_fields:
        fc = bad_fields[0]
        findings.append(Finding("data", "error", f"batch {b} holds {fc.nonfinite} NaN/Inf value(s) in {fc.field}", "fp32",
                                None, b, {"field": fc.field, "nonfinite": fc.nonfinite, "samples": fc.samples}, ""))
        fixes.append(f"Fix batch {b}: {fc.field} has NaN/Inf in samples {fc.samples[:10]}; filter them in "
                     "build_dataloader() (e.g. keep rows where torch.isfinite(x).all()) or fix the source data.")
        return verdict("data", None, b, "fp32",
                       f"Batch {b} holds {fc.nonfinite} NaN/Inf value(s) in {fc.field} (samples {fc.samples[:10]}); "
                       f"FP32 fails on it at step {s}, so precision is not the cause.")
    out = _outlier(batches, s)
    if out is not None:
        field_, ratio, samples = out
        findings.append(Finding("data", "error", f"batch {b} is an outlier ({field_} {ratio:.3g}x the median)", "fp32",
                                None, b, {"field": field_, "ratio_to_median": ratio, "samples": samples}, ""))
        fixes.append(f"Fix batch {b}: {field_} samples {samples[:10]} are {ratio:.3g}x larger than a typical batch")
        return verdict("data", None, b, "fp32",
                       f"FP32 fails at step {s} on batch {b}, whose field {field_!r} is {ratio:.3g}x larger than the median batch.")
    st = _stats_at(fp32, s)
    module = locate.locate_forward(st) if st is not None else None
    where = "forward"
    if module is None and st is not None and locate.backward_fault(st):
        module = locate.locate_backward(st)
        where = "backward"
    rc = recheck("initial", s)
    rec = fp32.records[s]
    ev: dict[str, object] = {"loss": rec.loss, "grad_l2": rec.grad_l2_pre_clip}
    if rc is not None:
        ev.update(replay_from_initial_weights_finite=rc.finite, replay_loss=rc.loss)
    diverged = rc is not None and rc.finite
    if diverged:
        norms = [r.grad_l2_pre_clip for r in fp32.records[:s] if math.isfinite(r.grad_l2_pre_clip)]
        gmax = max(norms) if norms else float("nan")
        ev["max_grad_l2_before"] = gmax
        detail = (f"batch {b} is finite and trains from the initial weights, so the weights diverged over {s} steps "
                  f"(largest gradient norm before: {_fmt(gmax)})")
        fix = "Lower the learning rate or clip gradients (--max-norm 1.0 to check), then rerun triage."
    else:
        loc = f"{module} ({where})" if module else "the loss function" if st is not None and not locate.forward_fault(st) else "the model"
        detail = f"batch {b} is finite, yet FP32 produces NaN/Inf in {loc} even from the initial weights"
        fix = (f"Guard the operation in {module or 'the loss'}: clamp before log/sqrt (x.clamp_min(eps)), "
               "add eps to denominators; check it with FP32 before touching precision.")
    findings.append(Finding("model_bug", "error", f"FP32 fails at step {s} on finite data", "fp32", module, s, ev, fix))
    fixes.append(fix)
    return verdict("model_bug", module, s, "fp32", f"FP32 fails at step {s} on finite data: {detail}.")


def _fix_forward(module: str | None, device: str) -> str:
    m = module or "the first layer"
    return (f"Run {m} in FP32: inside its forward, `with torch.autocast('{device.split(':')[0]}', enabled=False):` "
            "and cast its input with .float(); or train in bf16.")


def _fixes_forward(module: str | None, device: str, ev: dict[str, object]) -> list[str]:
    m = module or "the first layer"
    out = [f"Keep {m} in FP32: wrap its computation in `torch.autocast(device_type='{device.split(':')[0]}', enabled=False)` "
           "and call it on `x.float()`."]
    out.append("Or switch to bf16 autocast (FP32's exponent range, no GradScaler needed) if the device supports it: "
               "rerun with --target bf16 to check.")
    out.append(f"Or bring the values of {m} into range: normalise its input, scale before the product "
               "(e.g. divide q by sqrt(d) before q @ k^T), or use a numerically stable formulation.")
    return out


def _fix_grad_overflow(module: str | None, sd: ScalerStory | None) -> str:
    return (f"Gradients at {module or 'the loss'} exceed FP16's range even unscaled: normalise the loss "
            "(mean instead of sum), keep that module in FP32, or use bf16.")


def _fixes_grad_overflow(module: str | None, sd: ScalerStory | None, fp32: StageResult, device: str) -> list[str]:
    out = []
    if module:
        out.append(f"Keep {module} in FP32 under `torch.autocast('{device.split(':')[0]}', enabled=False)`: its gradients overflow FP16.")
    out.append("Reduce the loss magnitude (mean instead of sum over tokens/batch, or divide the loss by a constant): "
               "gradients scale with it.")
    out.append("Or switch to bf16 autocast (no overflow below 3.4e38, no scaler): rerun with --target bf16 to check.")
    if sd is not None and sd.min_scale < 1:
        out.append(f"GradScaler went down to {sd.min_scale:g}: below 1, it shrinks the gradients to fit FP16, so FP16 has no "
                   "headroom for them; any growth or a larger batch overflows again.")
    return out


def _underflow(stage: str, uf: list[tuple[str, float]], ratio: float | None, findings: list[Finding], fixes: list[str],
               verdict: Callable[..., Diagnosis], story: ScalerStory | None, fp32: StageResult) -> Diagnosis:
    param, frac = uf[0]
    module = param.rsplit(".", 1)[0] if "." in param else locate.MODEL
    ev: dict[str, object] = {"flushed": {p: round(f, 4) for p, f in uf[:10]}, "progress_vs_fp32": ratio}
    gmax = max((float(r[Col.ABSMAX]) for st in fp32.stats for r in st.pgrad.values() if nonfinite(r) == 0), default=0.0)
    if stage == "amp":
        if gmax > 0:
            # the largest power-of-two scale that keeps the largest gradient one binade below FP16's max
            k = math.floor(math.log2(FP16.max / gmax)) - 1
            ev["largest_fp32_grad"] = gmax
            ev["largest_safe_scale"] = f"2**{k}"
            used = story.max_scale if story else 65536.0
            if 2.0**k > used:
                fix = (f"The gradients are tiny (largest {gmax:.3g}): scale the loss up (normalise by fewer tokens), "
                       f"or start GradScaler at init_scale=2**{k} (the largest scale that still leaves a binade of headroom; "
                       f"it would take ~{int(math.log2(2.0**k / used)) * 2000} steps to grow there by itself); or use bf16.")
            else:
                fix = (f"No single loss scale fits every layer: keep {module} in FP32 under autocast(enabled=False), or use bf16; "
                       "a larger init_scale would overflow the largest gradients.")
        else:
            fix = f"Keep {module} in FP32 under autocast(enabled=False), or use bf16."
    else:
        fix = "Use loss scaling: torch.amp.GradScaler with autocast (the amp target), or bf16."
    findings.append(Finding("fp16_grad_underflow", "error", f"gradients of {len(uf)} parameter(s) flush to zero in FP16",
                            stage, module, None, ev, fix))
    fixes.append(fix)
    if stage != "amp":
        fixes.append("GradScaler multiplies the loss (init 65536) so small gradients stay above FP16's 6e-8, and unscales "
                     "them in FP32 before the step.")
    return verdict("fp16_grad_underflow", module, None, stage,
                   f"{frac:.0%} of {param}'s gradient flushes to zero in the {stage} stage (non-zero in FP32) and the "
                   f"loss makes {ratio:.0%} of FP32's progress." if ratio is not None else
                   f"{frac:.0%} of {param}'s gradient flushes to zero in the {stage} stage.")


def _swallowed(tgt: StageResult, fp32: StageResult, step: int | None, findings: list[Finding], fixes: list[str],
               verdict: Callable[..., Diagnosis], probe: StageResult | None) -> Diagnosis:
    sw = _mean_swallowed(tgt)
    ev: dict[str, object] = {"lost_update_share": sw, "optimizer_constants_underflowing": tgt.optimizer_underflow}
    why = []
    if tgt.optimizer_underflow:
        why.append(f"optimizer constant {', '.join(tgt.optimizer_underflow)} rounds to 0 in FP16")
    if sw > 0:
        why.append(f"{sw:.0%} of updates are lost in FP16 weights")
    fix = ("Keep FP32 master weights: train with autocast + GradScaler instead of model.half() "
           "(the optimizer then steps FP32 weights); if you must keep FP16 weights, raise Adam's eps to 1e-4.")
    findings.append(Finding("fp16_update_swallowed", "error", "updates are lost with FP16 weights", "fp16", None, step, ev, fix))
    fixes.append(fix)
    what = f"weights become non-finite at step {step}" if step is not None else "the loss stalls against FP32"
    return verdict("fp16_update_swallowed", None, step, "fp16",
                   f"With FP16 weights and optimizer state {what}: {'; '.join(why) or 'updates are lost'}, while FP32 trains.")


def _amp_misuse(tgt: StageResult, fp32: StageResult, probe: StageResult | None, step: int | None, hooks: list[str],
                ev: dict[str, object], findings: list[Finding], fixes: list[str], verdict: Callable[..., Diagnosis],
                why: str) -> Diagnosis:
    ev = dict(ev)
    if hooks:
        ev["hooks"] = hooks
    fix = ("Let GradScaler see overflows: remove gradient hooks that clamp or replace non-finite values "
           f"({_hooks_in(hooks)})" if hooks else
           "Check the AMP recipe: scale(loss).backward → unscale_ → clip → step → update, no gradient "
           "manipulation before unscale_, no hard-coded .half() inside the model")
    findings.append(Finding("amp_misuse", "error", "AMP itself is defeated", "amp", None, step, ev, fix))
    fixes.append(fix)
    st = f" at step {step}" if step is not None else ""
    return verdict("amp_misuse", None, step, "amp",
                   f"FP32 and raw FP16 train, but the amp stage fails{st}: {why}" + (f" (hooks found: {_hooks_in(hooks)})" if hooks else "") + ".")


def _warnings(results: dict[str, StageResult], tgt_name: str, fp32: StageResult, story: ScalerStory | None,
              uf: list[tuple[str, float]], findings: list[Finding], fixes: list[str]) -> None:
    if story and story.calibration_skips:
        findings.append(Finding("calibration_skips", "info",
                                f"{story.calibration_skips} GradScaler skip(s) while the scale calibrated from {story.init_scale:g}",
                                "amp", None, 0, {"scales": [e.scale for e in story.skips[: story.calibration_skips]]},
                                story.explanation))
    if uf:
        findings.append(Finding("fp16_grad_underflow", "warning",
                                f"{len(uf)} parameter gradient(s) flush to zero in {tgt_name} without stalling training",
                                tgt_name, uf[0][0].rsplit(".", 1)[0], None, {"flushed": dict(uf[:10])},
                                "Watch these layers; bf16 or keeping them in FP32 removes the flush."))
    probe = results.get("fp16")
    if probe is not None and tgt_name != "fp16":
        puf = underflowing_params(probe, fp32)
        if puf:
            findings.append(Finding("probe_underflow", "warning",
                                    f"raw FP16 without scaling flushes {len(puf)} parameter gradient(s) to zero; GradScaler cures it",
                                    "fp16", puf[0][0].rsplit(".", 1)[0], None, {"flushed": {p: round(f, 4) for p, f in puf[:10]}},
                                    "Keep GradScaler on; never train this model in FP16 without loss scaling."))
        pb = _first_bad_step(probe, amp=False)
        if pb is not None and probe.stats:
            findings.append(Finding("probe_nonfinite", "warning",
                                    f"raw FP16 without scaling goes non-finite at step {pb}; the target configuration avoids it",
                                    "fp16", None, pb, {}, "Keep autocast and GradScaler; do not train with model.half()."))
        sw = _mean_swallowed(probe)
        if sw > 0.1:
            findings.append(Finding("probe_swallowed", "warning",
                                    f"{sw:.0%} of the FP32 updates would be lost with FP16 weights",
                                    "fp16", None, None, {"lost_update_share": sw}, "Keep FP32 master weights (autocast does)."))
    thin = [(r.module, r.absmax_fp32, r.headroom_binades) for r in layer_table(results, tgt_name, 50)
            if r.kind == "activation" and r.headroom_binades < 1 and r.overflow_frac == 0]
    for m, amax, h in thin[:3]:
        findings.append(Finding("thin_headroom", "warning", f"{m} reaches {amax:.4g}, {h:.2f} binades below FP16's max",
                                tgt_name, m, None, {"absmax": amax, "headroom_binades": h},
                                f"Fine now; if it keeps growing, keep {m} in FP32 or use bf16."))


def not_reproduced(manifest: dict[str, object], reproduced: int, replays: int, last: list[dict[str, float | None]],
                   precision: str, step0: int, device: str) -> Diagnosis | None:
    """A captured failure that the replay in the run's own precision, from the captured state, does not
    repeat: a transient (nondeterminism, a hardware fault), not a property of the weights and the batch.

    None when at least one replay failed again. ``step0`` is the run's number of the first replayed step.
    """
    if reproduced > 0:
        return None
    step = int(str(manifest.get("step", step0)))
    module = manifest.get("module")
    mod = str(module) if isinstance(module, str) else None
    got = ", ".join(f"loss {_fmt(lv)}" if (lv := x.get("loss")) is not None else "no step" for x in last)
    ev: dict[str, object] = {"captured_reason": manifest.get("reason"), "captured_loss": manifest.get("loss"),
                             "captured_grad_l2": manifest.get("grad_l2_pre_clip"), "captured_scale": manifest.get("scale"),
                             "replays": replays, "replays_failed": reproduced, "replay_results": last}
    fix = ("Treat the step as transient: resume from the last checkpoint and watch whether it recurs. If it does, "
           "look for nondeterminism (torch.use_deterministic_algorithms(True), data-loader workers, atomics in "
           "custom kernels) and hardware faults (ECC errors and Xid events in nvidia-smi -q, or rerun the capture "
           "on another GPU).")
    rel = step - step0  # records count from the first replayed step; the report adds step0 back
    finding = Finding("not_reproduced", "error", f"the {precision} replay of step {step} from the captured state "
                      f"finished cleanly {replays} of {replays} times", precision, mod, rel, ev, fix)
    summary = (f"The run failed at step {step} ({manifest.get('reason')}), but replaying that step in {precision} from "
               f"the captured weights, optimizer and scaler state, on the captured batch, finished cleanly {replays} "
               f"times ({got}): the failure does not follow from the weights and the batch. It is a transient: "
               f"nondeterminism or a hardware fault, not FP16 range.")
    return Diagnosis(Verdict("not_reproduced", mod, rel, precision, summary, device), [finding], [], None, [fix])


def _forward_in_code(kind: str, op: NonfiniteOp | None, stage: str, step: int, rc_ev: dict[str, object], device: str,
                     findings: list[Finding], fixes: list[str], verdict: Callable[..., Diagnosis]) -> Diagnosis:
    """A forward fault made by code outside every child module: the loss function ('loss'), a loss
    the model computes in its own forward ('model_loss'), or other code of the root ('root')."""
    ev = dict(rc_ev)
    module = op.module if op is not None and op.module not in (None, locate.MODEL) else None
    if op is not None:
        ev.update(op=op.op, op_line=op.line, op_in={"loss": "loss function", "model_loss": "model's forward (its loss)",
                                                     "root": "model's forward"}[kind])
    op_s = f"`{op.op}`" + (f" at {op.line}" if op.line else "") if op is not None else "an op"
    dev = device.split(":")[0]
    if kind == "root" and module is None:
        what = f"{op_s} in the model's own forward (outside every submodule)"
        fix = (f"Run {op_s} in FP32: `with torch.autocast('{dev}', enabled=False):` around it, on `.float()` inputs; "
               "or rescale its inputs into FP16's range; or use bf16.")
        title = f"{op_s} in the model's forward overflows FP16"
    elif kind == "root":
        what = f"{op_s} inside {module}"
        fix = _fix_forward(module, device)
        title = f"{module} overflows FP16 in the forward pass"
    else:
        where = "the loss function" if kind == "loss" else "the loss the model computes in its forward"
        what = f"{op_s} in {where}"
        fix = (f"Compute the loss in FP32: on `.float()` logits under `torch.autocast('{dev}', enabled=False)`; or use the "
               "fused stable op: `F.binary_cross_entropy_with_logits` instead of sigmoid then log, `F.log_softmax` / "
               "`F.cross_entropy` instead of softmax then log (in FP16, sigmoid rounds to exactly 1.0 above ~8.3 "
               "and log(1 - p) is -inf).")
        title = f"the loss becomes non-finite in FP16 ({op_s})"
    findings.append(Finding("fp16_forward_overflow", "error", title, stage, module, step, ev, fix))
    fixes.append(fix)
    fixes.append("Or switch to bf16 autocast (FP32's exponent range) if the device supports it: rerun with --target bf16.")
    return verdict("fp16_forward_overflow", module, step, stage,
                   f"In the {stage} stage every module output is finite at step {step} but {what} turns finite values "
                   "into NaN/Inf" + (" while the FP32 re-check of that step from the same weights stays finite"
                                     if rc_ev.get("fp32_recheck_finite") else "") + ".")


def _frozen(stage: str, frozen: list[Frozen], uf: list[tuple[str, float]], ratio: float | None, steps: int,
            findings: list[Finding], fixes: list[str], verdict: Callable[..., Diagnosis], story: ScalerStory | None,
            fp32: StageResult) -> Diagnosis:
    """Parameters frozen by underflow while the loss still falls: the underflow verdict, said per parameter."""
    d = _underflow(stage, [(f.param, f.flushed) for f in frozen], ratio, findings, fixes, verdict, story, fp32)
    f0 = frozen[0]
    d.findings[0].evidence["weight_movement_vs_fp32"] = {f.param: round(f.moved, 4) for f in frozen[:10]}
    d.findings[0].title = f"{len(frozen)} parameter(s) frozen: gradients flush to zero in FP16 and the weights barely move"
    prog = f"; the loss still makes {ratio:.0%} of FP32's progress" if ratio is not None else ""
    d.verdict.summary = (f"{f0.flushed:.0%} of {f0.param}'s gradient (non-zero in FP32) flushes to zero in the {stage} stage "
                         f"and its weights move {f0.moved:.0%} as far as in FP32 over the same {steps} steps: "
                         f"{len(frozen)} parameter(s) are frozen{prog}.")
    return d


_DATA_WORDS = {"nonfinite": "NaN/Inf", "sentinel": "a repeated sentinel value", "outlier": "an outlier",
               "beyond_fp16": "values beyond FP16's range"}


def _describe_issue(d: DataIssue) -> str:
    if d.kind == "nonfinite":
        return f"batch {d.batches[0]} holds {d.count} NaN/Inf value(s) in {d.field} (samples {list(d.samples[:10])})"
    if d.kind == "sentinel":
        return (f"{d.field} holds the constant {d.value:g} {d.count} time(s) in {len(d.batches)} batch(es) (first: batch "
                f"{d.batches[0]}, samples {list(d.samples[:10])}), {abs(d.value) / d.typical:.3g}x its typical magnitude "
                f"{d.typical:.3g}: a fill value, not a measurement")
    if d.kind == "outlier":
        return (f"batch {d.batches[0]} holds an outlier: {d.field} reaches {d.value:.4g} in samples {list(d.samples[:10])}, "
                f"{d.value / d.typical:.3g}x its typical magnitude {d.typical:.3g}")
    return (f"batch {d.batches[0]} holds {d.field} values up to {d.value:.4g} (samples {list(d.samples[:10])}), "
            f"beyond FP16's max {FP16.max:g}")


def _data_findings(issues: list[DataIssue], findings: list[Finding], results: dict[str, StageResult],
                   batches: Batches) -> list[Finding]:
    """The data scan as findings (always), and whether the raw FP16 probe's failure follows the data."""
    named = {(f.step, f.evidence.get("field")) for f in findings if f.code == "data"}
    out = []
    for d in issues:
        if (d.batches[0], d.field) in named:
            continue
        ev: dict[str, object] = {"kind": d.kind, "field": d.field, "batches": list(d.batches[:20]),
                                 "samples": list(d.samples[:20]), "count": d.count, "typical_magnitude": d.typical}
        if d.kind != "nonfinite":
            ev["value"] = d.value
        fix = (f"Drop or fix these rows in build_dataloader() (e.g. mask {d.value:g} as missing)" if d.kind == "sentinel" else
               "Filter them in build_dataloader() (keep rows where torch.isfinite(x).all())" if d.kind == "nonfinite" else
               "Normalise this field (or clip it) in build_dataloader(); check the source of these samples")
        out.append(Finding(f"data_{d.kind}", "warning", _describe_issue(d), None, None,
                           d.batches[0], ev, fix))
    probe = results.get("fp16")
    if probe is not None:
        pb = _first_bad_step(probe, amp=False)
        pb = probe.error.step if pb is None and probe.error is not None else pb
        if pb is not None:
            b = batches.index(pb)
            on = probe_on_flagged_batch(pb, batches.index, issues)
            if on:
                out.append(Finding("probe_follows_data", "warning",
                                   f"raw FP16 first fails at step {pb}, on batch {b}, which holds {_DATA_WORDS[on[0].kind]} "
                                   f"that no earlier batch holds: the failure follows the data ({_describe_issue(on[0])})",
                                   "fp16", None, pb,
                                   {"batch": b, "kinds": sorted({d.kind for d in on})},
                                   f"Fix batch {b} first; then rerun triage."))
    return out
