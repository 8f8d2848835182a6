"""The English of a diagnosis, in one place: verdict summaries, finding titles and fixes, fix sentences.

The rules (``ampdoctor.judge.rules``) return data: a cause with a ``facts["variant"]``, findings
with a code and evidence, fixes as ``Fix(code, facts)``. This module turns them into the plain
sentences the Report carries (its JSON keeps the strings), formatting every number through
``ampdoctor.fmt``. It runs when the Report is built, after a replay's steps were shifted to the
run's own numbers, so every step in every sentence is the run's.

Evidence keys that start with ``_`` are facts for these words only; ``write`` drops them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ampdoctor.fmt import fixed, gen, num, pct0, pow2
from ampdoctor.formats import FP16
from ampdoctor.judge.progress import LossWindow
from ampdoctor.judge.rules import Diagnosis
from ampdoctor.records import Finding, Fix, ScalerStory, Verdict
from ampdoctor.report.words import inside
from ampdoctor.report.words import scaler as scaler_words

Facts = Mapping[str, Any]


def _g3(x: Any) -> str:
    return num(float(x), 3)


def _g4(x: Any) -> str:
    return num(float(x), 4)


def _op(f: Facts) -> str:
    """The op that made the NaN/Inf, as 'the `exp` at spec.py:13' names it (without 'the')."""
    op = f.get("op")
    if op is None:
        return "an op"
    line = f.get("op_line")
    return f"`{op}`" + (f" at {line}" if line else "")


def _first_layer(f: Facts) -> str:
    return f.get("module") or "the first layer"


def _hooks_in(hooks: list[str]) -> str:
    return ", ".join(hooks[:5])


# fixes ---------------------------------------------------------------------------------------------

def _bf16_tried(f: Facts) -> str:
    if f["variant"] == "raised":
        return f"bf16 was tried in this run and raised {f['type']} at step {f['step']}: {f['message'][:120]}"
    if f["variant"] == "nonfinite":
        return f"bf16 was tried in this run and also goes non-finite (step {f['step']}): the range is not the only problem."
    how = f", {pct0(f['ratio'])} of FP32's loss progress" if f.get("ratio") is not None else ""
    return f"bf16 was tried in this run: no non-finite values in {f['steps']} steps{how}. Switching to bf16 autocast fixes this."


FIXES: dict[str, Callable[[Facts], str]] = {
    "fix_exception": lambda f: f"Fix the {f['type']} raised in {f.get('module') or 'your code'} at step {f['step']}: {f['message']}",
    "filter_nonfinite_batch": lambda f: (
        f"Fix batch {f['batch']}: {f['field']} has NaN/Inf in samples {f['samples'][:10]}; filter them in "
        "build_dataloader() (e.g. keep rows where torch.isfinite(x).all()) or fix the source data."),
    "outlier_batch": lambda f: (
        f"Fix batch {f['batch']}: {f['field']} samples {f['samples'][:10]} are {_g3(f['ratio'])}x larger than a typical batch"),
    "lower_lr": lambda f: "Lower the learning rate or clip gradients (--max-norm 1.0 to check), then rerun triage.",
    "tame_schedule": lambda f: (
        f"Lower the learning rate the schedule reaches by step {f['step']}, or lengthen its warm-up so the peak comes "
        "later and lower; print the schedule's value at that step to check it."),
    "clip_update": lambda f: (
        "Clipping was on (--max-norm) and FP32 still exploded: lower the threshold or the learning rate." if f.get("clipped")
        else "Clip the gradient norm (torch.nn.utils.clip_grad_norm_ after scaler.unscale_(optimizer)); check it with "
             "triage --max-norm 1.0."),
    "loss_scale_objective": lambda f: (
        "Check the scale of the objective: a sum where a mean was meant, or a large loss weight, multiplies every "
        "gradient and so the step the learning rate takes."),
    "guard_op": lambda f: (
        f"Guard the operation in {f.get('module') or 'the loss'}: clamp before log/sqrt (x.clamp_min(eps)), "
        "add eps to denominators; check it with FP32 before touching precision."),
    "unmask_row": lambda f: (
        f"Fix the mask in {f['module']}: every query must keep at least one key it may attend to (a sequence that is all "
        "padding, or a left-padded position under a causal mask, keeps none). Drop such samples or unmask one key per "
        "row (e.g. the query's own position), or fill with torch.finfo(dtype).min instead of -inf and zero the "
        "fully masked rows' output; clamping or an eps does not help, the softmax is 0/0, and nan_to_num or torch.where "
        "on the output alone leaves the backward NaN where the mask is added to the scores."),
    "custom_fwd_bwd": lambda f: (
        f"Decorate {f['function']}.forward with `@torch.amp.custom_fwd(device_type='{f['device']}', cast_inputs=torch.float32)` "
        f"and {f['function']}.backward with `@torch.amp.custom_bwd(device_type='{f['device']}')`: forward then runs in FP32 "
        "with autocast off, and backward gets the same dtypes forward saw."),
    "device_limit": lambda f: str(f["hint"]),
    "work_under_autocast": lambda f: (
        f"Make {f.get('module') or 'the model'} work under autocast: it raised {f['type']}: {f['message']}"),
    "let_scaler_see": lambda f: (
        "Let GradScaler see overflows: remove gradient hooks that clamp or replace non-finite values "
        f"({_hooks_in(f['hooks'])})"),
    "check_amp_recipe": lambda f: (
        "Check the AMP recipe: scale(loss).backward → unscale_ → clip → step → update, no gradient "
        "manipulation before unscale_, no hard-coded .half() inside the model"),
    "op_fp32": lambda f: (
        f"Run {_op(f)} in FP32: `with torch.autocast('{f['device']}', enabled=False):` around it, on `.float()` inputs; "
        "or rescale its inputs into FP16's range; or use bf16."),
    "keep_fp32_forward": lambda f: (
        f"Run {_first_layer(f)} in FP32: inside its forward, `with torch.autocast('{f['device']}', enabled=False):` "
        "and cast its input with .float(); or train in bf16."),
    "loss_fp32": lambda f: (
        f"Compute the loss in FP32: on `.float()` logits under `torch.autocast('{f['device']}', enabled=False)`; or use the "
        "fused stable op: `F.binary_cross_entropy_with_logits` instead of sigmoid then log, `F.log_softmax` / "
        "`F.cross_entropy` instead of softmax then log (in FP16, sigmoid rounds to exactly 1.0 above ~8.3 "
        "and log(1 - p) is -inf)."),
    "bf16_target": lambda f: "Or switch to bf16 autocast (FP32's exponent range) if the device supports it: rerun with --target bf16.",
    "keep_fp32": lambda f: (
        f"Keep {_first_layer(f)} in FP32: wrap its computation in `torch.autocast(device_type='{f['device']}', enabled=False)` "
        "and call it on `x.float()`."),
    "bf16_autocast": lambda f: (
        "Or switch to bf16 autocast (FP32's exponent range, no GradScaler needed) if the device supports it: "
        "rerun with --target bf16 to check."),
    "into_range": lambda f: (
        f"Or bring the values of {_first_layer(f)} into range: normalise its input, scale before the product "
        "(e.g. divide q by sqrt(d) before q @ k^T), or use a numerically stable formulation."),
    "keep_fp32_backward": lambda f: (
        f"Keep {f['module']} in FP32 under `torch.autocast('{f['device']}', enabled=False)`: its gradients overflow FP16."),
    "reduce_loss": lambda f: (
        "Reduce the loss magnitude (mean instead of sum over tokens/batch, or divide the loss by a constant): "
        "gradients scale with it."),
    "bf16_no_overflow": lambda f: "Or switch to bf16 autocast (no overflow below 3.4e38, no scaler): rerun with --target bf16 to check.",
    "scale_below_one": lambda f: (
        f"GradScaler went down to {gen(f['min_scale'])}: below 1, it shrinks the gradients to fit FP16, so FP16 has no "
        "headroom for them; any growth or a larger batch overflows again."),
    "master_weights": lambda f: (
        "Keep FP32 master weights: train with autocast + GradScaler instead of model.half() "
        "(the optimizer then steps FP32 weights); if you must keep FP16 weights, raise Adam's eps to 1e-4."),
    "raise_init_scale": lambda f: (
        f"The gradients are tiny (largest {_g3(f['largest_grad'])}): scale the loss up (normalise by fewer tokens), "
        f"or start GradScaler at init_scale=2**{f['exponent']} (the largest scale that still leaves a binade of headroom; "
        f"it would take ~{f['growth_steps']} steps to grow there by itself); or use bf16."),
    "no_single_scale": lambda f: (
        f"No single loss scale fits every layer: keep {f['module']} in FP32 under autocast(enabled=False), or use bf16; "
        "a larger init_scale would overflow the largest gradients."),
    "module_fp32": lambda f: f"Keep {f['module']} in FP32 under autocast(enabled=False), or use bf16.",
    "use_loss_scaling": lambda f: "Use loss scaling: torch.amp.GradScaler with autocast (the amp target), or bf16.",
    "gradscaler_explained": lambda f: (
        "GradScaler multiplies the loss (init 65536) so small gradients stay above FP16's 6e-8, and unscales "
        "them in FP32 before the step."),
    "transient": lambda f: (
        "Treat the step as transient: resume from the last checkpoint and watch whether it recurs. If it does, "
        "look for nondeterminism (torch.use_deterministic_algorithms(True), data-loader workers, atomics in "
        "custom kernels) and hardware faults (ECC errors and Xid events in nvidia-smi -q, or rerun the capture "
        "on another GPU)."),
    "bf16_tried": _bf16_tried,
    "beyond_range_batch": lambda f: (
        f"Fix batch {f['batch']} in build_dataloader(): {f['field']}[{', '.join(map(str, f['position']))}] = "
        f"{gen(f['value'])} is no measurement FP16 can hold; mask or impute missing-value markers (and pass the mask), "
        "or rescale the field, before the model reads it."),
}
"""Fix code → the sentence, from the fix's facts."""


FIXES.update(inside.FIXES)


def fix_text(fix: Fix) -> str:
    return FIXES[fix.code](fix.facts)


# verdicts and the deciding rule's finding ---------------------------------------------------------

_AMP_WHY: dict[str, Callable[[Facts], str]] = {
    "damaged": lambda f: "weights reached at this step fail in FP32 too: AMP let damaged updates through",
    "probe_clean": lambda f: "GradScaler keeps skipping while raw FP16 gradients (no scaling) stay finite",
    "nonfinite_weights": lambda f: "weights became non-finite with finite gradients",
    "masked": lambda f: (
        f"{f['parameter']}'s gradient times the loss scale is {_g3(f['scaled'])}, beyond FP16's max, so it must "
        "overflow, yet it arrived at unscale_ as finite zeros: something replaced the infs, "
        "GradScaler never backed off and those gradients were dropped"),
    "stall": lambda f: "AMP's loss stalls against FP32 while raw FP16 shows no range problem",
}


def _amp_defeated(f: Facts) -> str:
    st = f" at step {f['step']}" if f.get("step") is not None else ""
    hooks = f.get("hooks") or []
    return (f"FP32 and raw FP16 train, but the amp stage fails{st}: {_AMP_WHY[f['why']](f)}"
            + (f" (hooks found: {_hooks_in(hooks)})" if hooks else "") + ".")


def _hook_hid(f: Facts) -> str:
    applied = (f"so GradScaler saw no inf and applied the update (gradient norm {_g4(f['norm'])}, FP32's "
               f"{_g4(f['fp32_norm'])}, at loss scale {_g3(f['scale'])})")
    if f["how"] == "probe":
        whose = f"the gradient of {f['param']}" if f.get("param") else f"the gradient entering {f['module']}"
        what = f"{whose} was already non-finite when {f['hook']} received it, and the hook made it finite, {applied}"
    elif f["how"] == "module_hook_input":
        what = (f"the gradient entering {f['module']} is non-finite, and {f['hook']} made it finite before "
                f"GradScaler looked, {applied}")
    else:
        what = (f"replayed without the model's gradient hooks, {f['params']} parameter gradient(s) overflow FP16 times the "
                f"loss scale (first {f['param']}); with them every gradient is finite, {applied}; the hook: {f['hook']}")
    more = len(f.get("hooks") or []) - 1
    return (f"A gradient hook hid an overflow from GradScaler at step {f['step']}: {what}"
            + (f" ({more} more hook(s) in the finding)" if more > 0 else "") + ".")


def _fp32_bug(f: Facts) -> str:
    loc = {"module": f"{f.get('module')} ({f.get('where')})", "loss": "the loss function", "model": "the model"}[f["location"]]
    m = f.get("masked")
    why = (f": its {m['op']} gets {m['rows']} row(s) masked throughout (first at index {tuple(m['first'])}){inside.samples(m)}, and a softmax "
           "over a row of -inf is 0/0 = NaN in every precision" if m else "")
    return (f"FP32 fails at step {f['step']} on finite data: batch {f['batch']} is finite, yet FP32 produces NaN/Inf in "
            f"{loc} {_from_start(f, even=True)}{why}.")


def _from_start(f: Facts, even: bool = False) -> str:
    """'even from the initial weights', 'from the captured weights at step 8,217', 'from checkpoint-130'."""
    start = f.get("start") or "the initial weights"
    return ("even from " if even and start == "the initial weights" else "from ") + str(start)


def _custom_where(f: Facts) -> str:
    fn = f["function"]
    return f"{f['module']}'s custom autograd.Function {fn}" if f.get("module") else f"custom autograd.Function {fn}"


_CODE_WHAT = {
    "root": lambda f: f"{_op(f)} in the model's own forward (outside every submodule)",
    "module": lambda f: f"{_op(f)} inside {f['module']}",
    "loss": lambda f: f"{_op(f)} in the loss function",
    "model_loss": lambda f: f"{_op(f)} in the loss the model computes in its forward",
}


def _forward_overflow(f: Facts) -> str:
    amax = f.get("fp32_absmax")
    op_s = f"its {f['op']} op " if f.get("op") is not None else ""
    amax_s = f" ({op_s}reaches {_g4(amax)} in FP32, above FP16's max {gen(FP16.max)})" if amax is not None and amax > FP16.max else ""
    rc = f.get("recheck_loss")
    return (f"In the {f['stage']} stage the output of {f.get('module') or 'the input cast'} becomes non-finite at step "
            f"{f['step']}{amax_s} while FP32 stays finite"
            + (f" (FP32 re-check of that step from the same weights: loss {_g4(rc)})" if rc is not None else "") + ".")


def _grad_overflow(f: Facts) -> str:
    how = {"collapsed": lambda: f"GradScaler's scale collapsed to {_g4(f['min_scale'])}",
           "skips": lambda: f"{f['skips_after_calibration']} steps skipped after calibration",
           "nonfinite": lambda: "gradients became non-finite"}[f["how"]]()
    first = (f.get("module") or (f"the model's own parameter {f['root_param']} (its gradient, made by the root's own code "
                                 "outside every submodule)" if f.get("root_param") else "the loss"))
    return (f"The forward pass is finite but gradients overflow FP16 in backward at step {f['step']} "
            f"(first at {first}); {how}.")


def _swallowed(f: Facts) -> str:
    why = []
    if f["optimizer_underflow"]:
        why.append(f"optimizer constant {', '.join(f['optimizer_underflow'])} rounds to 0 in FP16")
    if f["lost_share"] > 0:
        why.append(f"{pct0(f['lost_share'])} of updates are lost in FP16 weights")
    what = f"weights become non-finite at step {f['step']}" if f.get("step") is not None else "the loss stalls against FP32"
    return f"With FP16 weights and optimizer state {what}: {'; '.join(why) or 'updates are lost'}, while FP32 trains."


def _underflow(f: Facts) -> str:
    head = f"{pct0(f['flushed'])} of {f['param']}'s gradient flushes to zero in the {f['stage']} stage"
    if f.get("ratio") is None:
        return head + "."
    return f"{head} (non-zero in FP32) and the loss makes {pct0(f['ratio'])} of FP32's progress."


def _frozen(f: Facts) -> str:
    prog = f"; the loss still makes {pct0(f['ratio'])} of FP32's progress" if f.get("ratio") is not None else ""
    moves = (f"its weights move {pct0(f['moved'])} as far as in FP32 over the same {f['steps']} steps" if not f.get("decayed")
             else f"over all {f['steps']} steps: its weights move only by weight decay ({_g3(f['weight_decay'])}), "
                  f"{pct0(f['moved'])} as far as in FP32, where decay moves them too")
    return (f"{pct0(f['flushed'])} of {f['param']}'s gradient (non-zero in FP32) flushes to zero in the {f['stage']} stage "
            f"and {moves}: "
            f"{f['frozen']} parameter(s) are frozen{prog}."
            + (f" The first module backward reaches with more than half of its parameter gradients flushed is "
               f"{f['module']} ({pct0(f['first_flushed_frac'])} of {f['first_flushed']})." if f.get("first_flushed") else ""))


def _flushed_step(f: Facts) -> str:
    prog = f"; the loss still makes {pct0(f['ratio'])} of FP32's progress" if f.get("ratio") is not None else ""
    more = f" ({f['modules']} module(s) in all at that step)" if f.get("modules", 0) > 1 else ""
    return (f"At step {f['step']}, {pct0(f['share'])} of {f['module']}'s parameter gradients (non-zero in FP32 on the same "
            f"step) flush to zero in the {f['stage']} stage: the first module backward reaches with more than half of "
            f"them flushed{more}. Without loss scaling those updates are lost{prog}.")


def _beyond_range(f: Facts) -> str:
    pos = f"{f['field']}[{', '.join(map(str, f['position']))}]"
    vs = (f", {_g3(f['ratio'])}x the field's typical magnitude {_g3(f['typical'])}" if f.get("ratio") else "")
    more = f" ({f['count']} element(s) of that batch)" if f.get("count", 1) > 1 else ""
    seen = f"; batch {f['batch']} is seen at steps {_steps_list(f['steps'])}" if len(f.get("steps") or []) > 1 else ""
    failed = (f"the {f['stage']} stage fails on it at step {f['failed_step']}" if f.get("failed_step") == f["step"] else
              f"the {f['stage']} stage survives it (the op reading it keeps it in FP32) and trains on it"
              + (f", while raw FP16 fails on it at step {f['probe_step']}" if f.get("probe_step") == f["step"] else ""))
    return (f"Batch {f['batch']} holds a value FP16 cannot represent: {pos} = {gen(f['value'])}{vs}{more}, beyond FP16's "
            f"max {gen(FP16.max)} (cast to FP16 it is inf). The first module reading it is {f['module']}; {failed}{seen}.")


def _steps_list(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:4])) + (" ..." if len(steps) > 4 else "")


def _healthy(f: Facts) -> str:
    s = f"The {f['stage']} configuration trains like FP32"
    if f.get("ratio") is not None and f.get("window") is not None:
        s += f" ({describe(f['window'], f['stage'])})"
    elif f.get("ratio") is not None:
        s += f" ({pct0(f['ratio'])} of FP32's loss progress)"
    s += "; no non-finite values reached the weights."
    if f.get("calibration_skips"):
        s += f" {f['calibration_skips']} GradScaler skip(s) while the scale calibrated are normal."
    b = f.get("beyond_fp16")
    if b:
        s += (f" But the data holds values FP16 cannot represent: {b['field']} reaches {gen(b['value'])} (batch {b['batch']}), "
              f"beyond FP16's max {gen(FP16.max)}: cast to FP16 it is inf, so an op that reads it in FP16 makes inf "
              "(this run's did not; see the data finding).")
    return s


_PHASES = {
    "calibration": "probing a scale above any that had carried a step",
    "growth_probe": "probing a doubled scale after its growth interval",
    "isolated": "meeting one overflow at an established scale",
    "backoff": "backing off as the gradients grew to the scale's limit",
}


def _scaler_normal(f: Facts) -> str:
    where = f" in {f['module']}" if f.get("module") else ""
    s = (f"GradScaler working as designed: at step {f['step']} the gradients{where} overflowed FP16 only times the "
         f"loss scale" + (f" {_g3(f['scale'])}" if f.get("scale") else "") + f" (GradScaler was "
         f"{_PHASES.get(str(f.get('phase')), 'backing off')}), it skipped the step and backed off, and raw FP16 "
         "without scaling stays finite.")
    if f.get("absmax") and f.get("headroom") is not None:
        s += (f" Unscaled, their largest value is {_g3(f['absmax'])}: {_g3(f['headroom'])} binade(s) of FP16 headroom, "
              "room for a scale up to about 2^" + f"{max(int(f['headroom']), 0)}.")
    return s


def _not_reproduced(f: Facts) -> str:
    got = ", ".join(f"loss {_g4(lv)}" if lv is not None else "no step" for lv in f["losses"])
    return (f"The run failed at step {f['step']} ({f['reason']}), but replaying that step in {f['precision']} from "
            f"the captured weights, optimizer and scaler state, on the captured batch, finished cleanly {f['replays']} "
            f"times ({got}): the failure does not follow from the weights and the batch. It is a transient: "
            "nondeterminism or a hardware fault, not FP16 range.")


SUMMARIES: dict[str, Callable[[Facts], str]] = {
    "fp32_raised": lambda f: f"The FP32 reference raises {f['type']} at step {f['step']}: {f['message']}",
    "fp32_data_nonfinite": lambda f: (
        f"Batch {f['batch']} holds {f['count']} NaN/Inf value(s) in {f['field']} (samples {f['samples'][:10]}); "
        f"FP32 fails on it at step {f['step']}, so precision is not the cause."),
    "fp32_data_outlier": lambda f: (
        f"FP32 fails at step {f['step']} on batch {f['batch']}, whose field {f['field']!r} is {_g3(f['ratio'])}x larger "
        "than the median batch."),
    "fp32_diverged": lambda f: (
        f"FP32 fails at step {f['step']} on finite data: batch {f['batch']} is finite and trains {_from_start(f)}, "
        f"so the weights diverged over {f['steps_before']} steps (largest gradient norm before: {_g4(f['max_grad_l2'])})."),
    "fp32_bug": _fp32_bug,
    "fp32_exploded": lambda f: (
        f"FP32 diverges too: its update at step {f['step']} has a gradient norm of {_g4(f['grad_l2'])}, "
        f"{_g3(f['ratio'])}x the median of the {f['history']} applied steps before it (the Monitor's exploding update; "
        f"the run's failure was captured at step {f['captured_step']}), and its loss goes from {_g4(f['first_loss'])} "
        f"to {_g4(f['max_loss'])} with every value finite. The training diverges whatever the precision."),
    "no_target": lambda f: "FP32 trains cleanly; no target stage was run.",
    "custom_function": lambda f: (
        f"The backward of {_custom_where(f)} raises {f['type']} at step {f['step']} ({f['message'][:120]}): under autocast it "
        "receives FP16 tensors next to FP32 ones, because the Function has no custom_fwd/custom_bwd."),
    "target_raised": lambda f: (
        f"The {f['stage']} configuration {'cannot run' if f['device_limit'] else 'breaks'} on {f['device']}: {f['type']} in "
        f"{f.get('module') or 'user code'} at step {f['step']} ({f['message'][:120]}). {f['hint']}"),
    "target_outlier": lambda f: (
        f"Step {f['step']} of the {f['stage']} stage fails on batch {f['batch']}, whose field {f['field']!r} is "
        f"{_g3(f['ratio'])}x larger than the median batch: the failure follows the data."),
    "amp_defeated": _amp_defeated,
    "hook_hid_overflow": _hook_hid,
    "forward_in_code": lambda f: (
        f"In the {f['stage']} stage every {'module' if f.get('kind') == 'loss' else 'submodule'} output is finite at step "
        f"{f['step']} but {_CODE_WHAT[f['place']](f)} turns "
        "finite values into NaN/Inf" + (" while the FP32 re-check of that step from the same weights stays finite"
                                        if f.get("recheck_finite") else "") + "."),
    "forward_overflow": _forward_overflow,
    "grad_overflow": _grad_overflow,
    "swallowed": _swallowed,
    "underflow": _underflow,
    "frozen": _frozen,
    "flushed_step": _flushed_step,
    "beyond_range_batch": _beyond_range,
    "stall": lambda f: f"The {f['stage']} stage makes {pct0(f['ratio'])} of FP32's loss progress without any non-finite value.",
    "healthy": _healthy,
    "scaler_normal": _scaler_normal,
    "not_reproduced": _not_reproduced,
}
"""Verdict variant (``Outcome.facts["variant"]``) → the verdict's summary."""


def _code_title(f: Facts) -> str:
    if f["place"] == "root":
        return f"{_op(f)} in the model's forward overflows FP16"
    if f["place"] == "module":
        return f"{f['module']} overflows FP16 in the forward pass"
    return f"the loss becomes non-finite in FP16 ({_op(f)})"


RULE_TITLES: dict[str, Callable[[Facts], str]] = {
    "fp32_raised": lambda f: f"fp32 stage raised {f['type']} at step {f['step']}",
    "fp32_data_nonfinite": lambda f: f"batch {f['batch']} holds {f['count']} NaN/Inf value(s) in {f['field']}",
    "fp32_data_outlier": lambda f: f"batch {f['batch']} is an outlier ({f['field']} {_g3(f['ratio'])}x the median)",
    "fp32_diverged": lambda f: f"FP32 fails at step {f['step']} on finite data",
    "fp32_bug": lambda f: f"FP32 fails at step {f['step']} on finite data",
    "fp32_exploded": lambda f: f"FP32's update explodes at step {f['step']} ({_g3(f['ratio'])}x the recent gradient norm)",
    "custom_function": lambda f: f"{_custom_where(f)} raises {f['type']} in backward under autocast",
    "target_raised": lambda f: f"{f['stage']} stage raised {f['type']} in {f.get('module') or 'user code'} at step {f['step']}",
    "target_outlier": lambda f: f"batch {f['batch']} is an outlier: {f['field']} is {_g3(f['ratio'])}x the median batch",
    "amp_defeated": lambda f: "AMP itself is defeated",
    "hook_hid_overflow": lambda f: f"a gradient hook hid an overflow from GradScaler ({f['hook']})",
    "forward_in_code": _code_title,
    "forward_overflow": lambda f: f"{f.get('module') or 'the input'} overflows FP16 in the forward pass",
    "grad_overflow": lambda f: f"gradients overflow FP16 in backward ({f.get('module') or 'at the loss'})",
    "swallowed": lambda f: "updates are lost with FP16 weights",
    "underflow": lambda f: f"gradients of {f['parameters']} parameter(s) flush to zero in FP16",
    "frozen": lambda f: f"{f['frozen']} parameter(s) frozen: gradients flush to zero in FP16 and the weights barely move",
    "flushed_step": lambda f: f"{f['module']}'s gradients flush to zero in FP16 at step {f['step']}",
    "beyond_range_batch": lambda f: f"batch {f['batch']} holds {gen(f['value'])}, beyond FP16's range",
    "stall": lambda f: "training stalls against FP32",
    "scaler_normal": lambda f: f"GradScaler skipped step {f['step']} and backed off, as designed",
    "not_reproduced": lambda f: (
        f"the {f['precision']} replay of step {f['step']} from the captured state finished cleanly {f['replays']} of "
        f"{f['replays']} times"),
}
"""Verdict variant → the title of the deciding rule's finding."""
SUMMARIES.update(inside.SUMMARIES)
RULE_TITLES.update(inside.TITLES)

RULE_FINDING_FIX: dict[str, Callable[[Facts], str]] = {
    "fp32_raised": lambda f: "Fix the exception; it is not a precision issue.",
    "fp32_data_nonfinite": lambda f: "",
    "fp32_data_outlier": lambda f: "",
    "target_outlier": lambda f: (
        f"Fix batch {f['batch']} ({f['field']}, samples {f['samples'][:10]}): normalise or drop it in build_dataloader()."),
    "target_raised": lambda f: str(f["hint"]),
    "forward_overflow": lambda f: fix_text(Fix("keep_fp32_forward", {"module": f.get("module"), "device": f["device"]})),
    "grad_overflow": lambda f: (
        f"Gradients at {f.get('module') or 'the loss'} exceed FP16's range even unscaled: normalise the loss "
        "(mean instead of sum), keep that module in FP32, or use bf16."),
    "stall": lambda f: "Use GradScaler (autocast + loss scaling) or bf16.",
}
"""Verdict variant → the fix its finding carries, where that is not the outcome's first fix."""


def _rule_fix(variant: str, facts: Facts, fixes: list[Fix]) -> str:
    if variant in RULE_FINDING_FIX:
        return RULE_FINDING_FIX[variant](facts)
    return fix_text(fixes[0]) if fixes else ""


# findings that stand on their evidence: warnings and the data scan --------------------------------

_DATA_WORDS = {"nonfinite": "NaN/Inf", "sentinel": "a repeated sentinel value", "outlier": "an outlier",
               "beyond_fp16": "values beyond FP16's range"}


def data_issue(d: Facts) -> str:
    """One data-scan issue (``rules._issue_facts``) in words (a value beyond FP16's range says so)."""
    s = _data_issue(d)
    if d.get("beyond_fp16") and d["kind"] != "beyond_fp16":
        s += f"; beyond FP16's max {gen(FP16.max)}: FP16 cannot represent it (cast to FP16 it is inf)"
    return s


def _data_issue(d: Facts) -> str:
    b, field, samples = d["batch"], d["field"], d["samples"]
    if d["kind"] == "nonfinite":
        return f"batch {b} holds {d['count']} NaN/Inf value(s) in {field} (samples {samples})"
    if d["kind"] == "sentinel":
        return (f"{field} holds the constant {gen(d['value'])} {d['count']} time(s) in {d['batches']} batch(es) (first: batch "
                f"{b}, samples {samples}), {_g3(d['ratio'])}x its typical magnitude {_g3(d['typical'])}: a fill value, "
                "not a measurement")
    if d["kind"] == "outlier":
        return (f"batch {b} holds an outlier: {field} reaches {_g4(d['value'])} in samples {samples}, "
                f"{_g3(d['ratio'])}x its typical magnitude {_g3(d['typical'])}")
    return f"batch {b} holds {field} values up to {_g4(d['value'])} (samples {samples}), beyond FP16's max {gen(FP16.max)}"


def _data_fix(d: Facts) -> str:
    if d["kind"] == "sentinel":
        return f"Drop or fix these rows in build_dataloader() (e.g. mask {gen(d['value'])} as missing)"
    if d["kind"] == "nonfinite":
        return "Filter them in build_dataloader() (keep rows where torch.isfinite(x).all())"
    return "Normalise this field (or clip it) in build_dataloader(); check the source of these samples"


def _probe_follows(f: Finding) -> str:
    ev, issue = f.evidence, f.evidence["_issue"]
    return (f"raw FP16 first fails at step {f.step}, on batch {ev['batch']}, which holds {_DATA_WORDS[issue['kind']]} "
            f"that no earlier batch holds: the failure follows the data ({data_issue(issue)})")


FindingWords = Callable[[Finding, ScalerStory | None], tuple[str, str]]

FINDINGS: dict[str, FindingWords] = {
    "scaler_normal": lambda f, s: (
        f"GradScaler skipped step {f.step} at scale {gen(f.evidence['scale']) if f.evidence.get('scale') else '?'} "
        f"({str(f.evidence.get('phase', '')).replace('_', ' ')}) and backed off: its normal working",
        "Nothing to change. Monitor(capture_on='failure'), the default, does not capture these skips."),
    "calibration_skips": lambda f, s: (
        f"{f.evidence['_count']} GradScaler skip(s) while the scale calibrated from {gen(f.evidence['_init_scale'])}",
        s.explanation if s is not None else ""),
    "fp16_grad_underflow": lambda f, s: (
        f"{f.evidence['_count']} parameter gradient(s) flush to zero in {f.stage} without stalling training",
        "Watch these layers; bf16 or keeping them in FP32 removes the flush."),
    "probe_underflow": lambda f, s: (
        f"raw FP16 without scaling flushes {f.evidence['_count']} parameter gradient(s) to zero; GradScaler cures it",
        "Keep GradScaler on; never train this model in FP16 without loss scaling."),
    "probe_nonfinite": lambda f, s: (
        f"raw FP16 without scaling goes non-finite at step {f.step}; the target configuration avoids it",
        "Keep autocast and GradScaler; do not train with model.half()."),
    "probe_swallowed": lambda f, s: (
        f"{pct0(f.evidence['lost_update_share'])} of the FP32 updates would be lost with FP16 weights",
        "Keep FP32 master weights (autocast does)."),
    "thin_headroom": lambda f, s: (
        f"{f.module} reaches {_g4(f.evidence['absmax'])}, {fixed(f.evidence['headroom_binades'])} binades below FP16's max",
        f"Fine now; if it keeps growing, keep {f.module} in FP32 or use bf16."),
    **{f"data_{k}": (lambda f, s: (data_issue(f.evidence["_issue"]), _data_fix(f.evidence["_issue"]))) for k in _DATA_WORDS},
    "probe_follows_data": lambda f, s: (_probe_follows(f), f"Fix batch {f.evidence['batch']} first; then rerun triage."),
}
"""Finding code → (title, fix) for findings that are not the deciding rule's own."""

def _forward_fault(sc: ScalerStory) -> str:
    """The skips of a run whose forward pass overflows: how many the forward made, and what they did to the scale."""
    n = len(sc.skips)
    fwd = sum(1 for e in sc.skips if e.reason == "nonfinite_loss")
    fell = f"from {pow2(sc.init_scale)} to {pow2(sc.min_scale)}"
    if not fwd or fwd == n:
        return (f"{n} skip(s) follow the non-finite values the forward pass makes (see the verdict), not calibration: "
                f"no loss scale changes a forward value, yet GradScaler halves its scale at each, so the scale fell {fell}.")
    grad = [e for e in sc.skips if e.reason != "nonfinite_loss"]
    # a skip on a non-finite loss is never calibration (judge.scaler.diagnose_scale), so the calibration skips are
    # gradient overflows: all of them are calibration when there are as many
    calibrating = len(grad) <= sc.calibration_skips
    rest = (f"The other {len(grad)} are gradient overflows while the scale came down from {pow2(sc.init_scale)}: "
            "GradScaler calibrating, as designed. The gradients are not the problem: fix the forward pass."
            if calibrating else
            f"The other {len(grad)} are gradient overflows, at steps {', '.join(str(e.step) for e in grad[:10])}.")
    return (f"{fwd} of the {n} skips follow a non-finite loss, the forward overflow the verdict names, not calibration: "
            "no loss scale changes a forward value, yet GradScaler halves its scale at each one, so the scale fell "
            f"{fell}. " + rest)


SCALER_NOTES: dict[str, Callable[[ScalerStory], str]] = {
    "overflows_hidden": lambda sc: (
        "The scale never backed off, but not because the gradients fit: the overflows were hidden from GradScaler "
        "before unscale_ (see the verdict)."),
    "forward_fault": _forward_fault,
}
"""A note that replaces the scale history's own explanation, where the verdict knows better."""


def hooks_kept(kept: list[str], lost: list[str], total: int) -> list[str]:
    """The replay's notes on the run's gradient hooks (the capture's ``user_hooks``): those the spec's model registers
    again are kept, the others are listed as not re-created (a capture keeps no code)."""
    out = []
    if kept:
        out.append(f"the run's model carried {total} gradient hook(s); the replay keeps {len(kept)} (the spec's model "
                   "registers them): " + "; ".join(kept[:5]) + (" ..." if len(kept) > 5 else ""))
    if lost:
        out.append(f"{len(lost)} of the run's gradient hook(s) were not re-created in the replay (the spec's model does not "
                   "register them; a hook is code, which a capture does not keep): " + "; ".join(lost[:5])
                   + (" ..." if len(lost) > 5 else ""))
    return out


# the whole diagnosis -------------------------------------------------------------------------------

def summary(facts: Facts) -> str:
    return SUMMARIES[facts["variant"]](facts) + inside.extra(facts)


def write(d: Diagnosis) -> tuple[Verdict, list[Finding], list[str], ScalerStory | None]:
    """The verdict, findings, fix sentences and scaler story of a diagnosis, with their words written.

    The deciding rule's finding (the first, unless the verdict is healthy) is worded from the
    outcome's facts; every other finding from its code and evidence.
    """
    o = d.outcome
    variant = str(o.facts["variant"])
    verdict = Verdict(o.cause, o.module, o.step, o.stage, summary(o.facts), d.device)
    scaler = d.scaler
    if scaler is not None and d.scaler_note is not None:
        scaler = replace(scaler, explanation=SCALER_NOTES[d.scaler_note](scaler))
    elif scaler is not None and d.scale is not None:
        scaler = replace(scaler, explanation=scaler_words.story(d.scale))
    findings = []
    for i, f in enumerate(o.findings):
        if i == 0 and variant in RULE_TITLES:
            title, fix = RULE_TITLES[variant](o.facts), _rule_fix(variant, o.facts, o.fixes)
        else:
            title, fix = FINDINGS[f.code](f, scaler)
        ev = {k: OP_PLACES.get(v, v) if k == "op_in" else v for k, v in f.evidence.items() if not k.startswith("_")}
        findings.append(replace(f, title=title, fix=fix, evidence=ev))
    return verdict, findings, [fix_text(fx) for fx in o.fixes], scaler


def describe(w: LossWindow, name: str) -> str:
    """'mean loss over steps 36-47: amp 0.62, FP32 0.58, both down from FP32's 2.31 over steps 0-11 (107% of FP32's progress)'."""
    last = f"{w.steps - w.window}-{w.steps - 1}"
    return (f"mean loss over steps {last}: {name} {w.target_tail:.4g}, FP32 {w.fp32_tail:.4g}, from FP32's "
            f"{w.fp32_head:.4g} over steps 0-{w.window - 1}: {w.ratio:.0%} of FP32's progress")


# evidence as sentences ------------------------------------------------------------------------------

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
                + (f" (loss {_g4(loss)})." if loss is not None else "."))
    return f"Re-run in FP32 from the same weights{where}, the step is non-finite too" + (
        f" (loss {_g4(loss)})." if loss is not None else ".")


def _ev_range(ev: Facts, module: str | None) -> str | None:
    amax = ev.get("fp32_absmax")
    if amax is None:
        return None
    inside = f" in {module}" if module else ""
    what = f"The `{ev['op']}` op{inside}" if ev.get("op") else f"The output of {module}" if module else "The output"
    fmax = float(ev.get("fp16_max", FP16.max))
    s = f"{what} reaches {_g4(amax)} in FP32"
    amax = float(amax)
    if amax > fmax:
        s += f", {_g3(amax / fmax)} times FP16's largest value {gen(fmax)} (headroom {fixed(FP16.headroom_binades(amax))} binades)"
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
        parts.append(f"the loss is {_g4(ev['loss'])}")
    if "grad_l2" in ev:
        parts.append(f"the gradient norm (L2, before clipping) is {_g4(ev['grad_l2'])}")
    if "max_grad_l2_before" in ev:
        parts.append(f"the largest gradient norm of the steps before is {_g4(ev['max_grad_l2_before'])}")
    if not parts:
        return None
    s = "At that step " + ", ".join(parts) + "."
    if "replay_from_initial_weights_finite" in ev:
        fin = "finite" if ev["replay_from_initial_weights_finite"] else "non-finite"
        s += f" The same batch from the initial weights gives a {fin} loss" + (
            f" ({_g4(ev['replay_loss'])})." if ev.get("replay_loss") is not None else ".")
    return s


def _ev_scaler(ev: Facts) -> str | None:
    if "min_scale" not in ev and "skipped_steps" not in ev:
        return None
    s = (f"GradScaler skipped {ev.get('skipped_steps', 0)} step(s) and its scale went down to "
         f"{pow2(ev.get('min_scale'))}" + (f" (pattern: {ev['pattern']})" if ev.get("pattern") else "") + ".")
    return s


def _ev_grad_fp32(ev: Facts) -> str | None:
    if "grad_l2_fp32_step" not in ev:
        return None
    return f"FP32's gradient norm (L2) at that step is {_g4(ev['grad_l2_fp32_step'])}."


def _ev_scaled_param(ev: Facts) -> str | None:
    if "fp32_grad_absmax_x_scale" not in ev:
        return None
    return (f"{ev.get('parameter')}'s largest FP32 gradient times the loss scale is {_g3(ev['fp32_grad_absmax_x_scale'])}, "
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
        s += f" The largest FP32 gradient is {_g3(ev['largest_fp32_grad'])}"
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
    s = f"GradScaler was at scale {pow2(ev.get('scale'))}, {_PHASES.get(str(ev['phase']), 'backing off')}."
    if ev.get("grad_absmax_unscaled"):
        s += f" Unscaled, the largest gradient is {_g3(ev['grad_absmax_unscaled'])}"
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
        return f"Field {ev['field']!r} is {_g3(ev['ratio_to_median'])} times the median batch's magnitude{at}."
    return None


def _ev_error(ev: Facts) -> str | None:
    msg = ev.get("error") or ev.get("message")
    if not msg:
        return None
    fn = f" in custom autograd.Function {ev['function']}" if ev.get("function") else ""
    return f"The error{fn}: {msg}."


def _ev_hooks(ev: Facts) -> str | None:
    return f"Gradient hooks on the model: {_hooks_in(list(ev['hooks']))}." if ev.get("hooks") else None


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


def stage_stopped(what: str, step: int) -> str:
    """Why a stage stopped early (``what``: 'loss' or 'weights'), at the run's ``step``."""
    return f"{what} became non-finite at step {step}"


def replay_scaler(scale: float, steps: int, manifest: Facts) -> str:
    """GradScaler's story of a replay from a capture: where it started, and where the run's own scale history is
    (the capture's ``step_log``; a capture without one says so, and how to keep one)."""
    s = f"The replay started from the run's captured scale {pow2(scale)} and ran {steps} step(s)."
    log = manifest.get("step_log")
    if log:
        return s + f" The run's whole scale history is in its step log: `ampdoctor scaler {log}`."
    if "step_log" in manifest:
        return s + (" The run kept no step log, so its scale history is not known here: Monitor(log='steps.csv') "
                    "keeps one for `ampdoctor scaler`.")
    return s + " If the run kept a step log (Monitor(log=...)), `ampdoctor scaler` on it tells the run's whole scale history."


def what_ran(tool: str, config: Facts, steps: int | None) -> str:
    """The line under a report's title: the command, the target, how many steps, from where.
    'ampdoctor triage of forward_overflow.py: the amp stage against FP32, 50 steps from the initial weights'."""
    spec = str(config.get("spec") or "")
    name = spec.replace("\\", "/").rsplit("/", 1)[-1] if spec else ""
    head = f"{tool} of {name}" if name else tool
    target = config.get("target")
    what = [f"the {target} stage against FP32" if target else ""]
    if steps:
        what.append(f"{steps:,} step{'s' if steps != 1 else ''} from {config.get('start') or 'the initial weights'}")
    cap = config.get("from_capture")
    if cap:
        what.append(f"replayed from the capture {cap}")
    elif config.get("checkpoint"):
        what.append(f"from the checkpoint {config['checkpoint']}")
    body = ", ".join(w for w in what if w)
    return f"{head}: {body}" if body else head


# the lookback ring: the forecast, the spike, the story before a failure ---------------------------

def forecast_message(fc: Any, fixes: list[Fix], more: int = 0) -> str:
    """The forecast warning (``judge.history.Forecast``): the layer, its headroom, its growth, the expected step,
    and the fixes triage gives for a forward overflow of that layer."""
    others = f" ({more} more layer(s) on the same course)" if more else ""
    head = (f"ampdoctor: step {fc.step}: {fc.layer} is on course to overflow FP16: its output's largest |x| is "
            f"{_g3(fc.absmax)}, {fixed(fc.headroom, 1)} binade(s) below FP16's max {gen(FP16.max)}, and grows "
            f"{_g3(fc.slope)} a step ({fixed(fc.binades_per_100, 2)} binade(s) of headroom per 100 steps); "
            + (f"accelerating as it does, it passes the max at about step {fc.expected_step:,} (by step "
               f"{fc.latest_step:,} if it grew no faster than now)" if fc.expected_step < fc.latest_step else
               f"at that rate it passes the max by step {fc.latest_step:,}, sooner if the growth compounds")
            + others)
    return head + "".join(f"\n  {i}. {fix_text(fx)}" for i, fx in enumerate(fixes, 1))


def spike_message(sp: Any) -> str:
    """'ampdoctor: step 412: loss spike: the loss 9.1 is 14.2 robust standard deviations above ...'."""
    what = {"loss": "the loss", "grad_norm": "the gradient norm"}.get(sp.what, sp.what)
    s = (f"ampdoctor: step {sp.step} failed: a {sp.what.replace('_', ' ')} spike: {what} {_g4(sp.value)} is "
         f"{fixed(sp.z, 1)} robust standard deviations above the median {_g4(sp.median)} of the steps before it")
    if sp.layers:
        s += "; update norms spiked first in " + ", ".join(
            f"{h['layer']} (step {h['step']}, {fixed(h['ratio'], 1)}x its median)" for h in sp.layers[:3])
    return s


_MOVER_FIG = {"absmax": "output |x|", "grad_norm": "gradient norm", "update_norm": "update norm"}


def change_text(c: Mapping[str, Any]) -> str:
    k = c["kind"]
    if k == "warmup_end":
        return f"the learning rate stopped rising at step {c['step']} (end of warm-up, lr {_g3(c['lr'])})"
    if k == "input_size":
        return f"the model's input changed size at step {c['step']}: {gen(c['before'])} to {gen(c['after'])} elements"
    if k == "batch_spike":
        return (f"the batch of step {c['step']} spiked: its largest |x| {_g3(c['value'])} against a median of "
                f"{_g3(c['median'])} ({fixed(c['z'], 1)} robust sd)")
    if k == "loss_spike":
        return (f"the loss spiked at step {c['step']}: {_g4(c['value'])} against a median of {_g4(c['median'])} "
                f"({fixed(c['z'], 1)} robust sd)")
    return f"{k} at step {c.get('step')}"


def mover_text(m: Mapping[str, Any]) -> str:
    d = m["binades_at_end"]
    return (f"{m['layer']}: its {_MOVER_FIG.get(m['figure'], m['figure'])} left its baseline at step {m['left_step']} "
            f"and ended {fixed(abs(d), 1)} binade(s) {'above' if d > 0 else 'below'} it")


def history_title(ev: Mapping[str, Any]) -> str:
    """The story finding's title: the culprit's headroom over the kept steps, and where it crossed."""
    kept = f"the last {ev['steps_kept']} steps ({ev['first_step']}-{ev['fail_step']})"
    layer = ev.get("layer")
    if ev.get("data"):  # the batch's own NaN/Inf went through: no headroom ran out, and the title says so
        low, bad = ev.get("least_headroom"), ev.get("nonfinite_step")
        said = ([f"no layer came near FP16's max (least headroom {fixed(float(low['binades']), 1)} binade(s), "
                 f"{low['layer']})"] if low else []) + ([f"the values went non-finite at step {bad} with the batch, "
                                                         "not by an overflow"] if bad is not None else [])
        return f"Before the failure, over {kept}: " + ("; ".join(said) if said else "kept by the lookback ring")
    if not layer:
        return f"Before the failure: {kept} kept by the lookback ring"
    h0, h1 = ev.get("headroom_first", math.nan), ev.get("headroom_last", math.nan)
    cross = (f", and reached 0 at step {ev['crossed_step']}" if ev.get("crossed_step") is not None
             else ", and never reached 0 in the kept steps")
    return (f"Before the failure, over {kept}: {layer}'s FP16 headroom went from {fixed(float(h0), 1)} to {fixed(float(h1), 1)} "
            f"binade(s){cross}")


def history_lines(ev: Mapping[str, Any]) -> list[str]:
    """The story's figures as sentences: who moved first, and what changed."""
    out = []
    if ev.get("absmax_first") is not None and ev.get("absmax_peak") is not None and ev.get("layer"):
        out.append(f"{ev['layer']}'s largest |x|: {_g3(ev['absmax_first'])} at step {ev['first_step']}, up to "
                   f"{_g3(ev['absmax_peak'])} at step {ev['absmax_peak_step']} while finite (FP16's max {gen(FP16.max)})")
    movers = ev.get("movers") or []
    if movers:
        out.append("moved first: " + "; ".join(mover_text(m) for m in movers))
    ch = ev.get("changes") or []
    out.append("what changed: " + ("; ".join(change_text(c) for c in ch) if ch else
                                  "no warm-up end, new input size or spiking batch in the kept steps"))
    return out
