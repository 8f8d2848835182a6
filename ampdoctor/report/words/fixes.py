"""The fix sentences, by ``Fix.code`` (``FIXES``; ``fix_text`` writes one from its facts)."""

from __future__ import annotations

from collections.abc import Callable

from ampdoctor.fmt import gen, pct0
from ampdoctor.records import Fix
from ampdoctor.report.words import inside
from ampdoctor.report.words.common import Facts, first_layer, g3, hooks_in, op_name


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
        f"Fix batch {f['batch']}: {f['field']} samples {f['samples'][:10]} are {g3(f['ratio'])}x larger than a typical batch"),
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
        f"({hooks_in(f['hooks'])})"),
    "check_amp_recipe": lambda f: (
        "Check the AMP recipe: scale(loss).backward → unscale_ → clip → step → update, no gradient "
        "manipulation before unscale_, no hard-coded .half() inside the model"),
    "op_fp32": lambda f: (
        f"Run {op_name(f)} in FP32: `with torch.autocast('{f['device']}', enabled=False):` around it, on `.float()` inputs; "
        "or rescale its inputs into FP16's range; or use bf16."),
    "keep_fp32_forward": lambda f: (
        f"Run {first_layer(f)} in FP32: inside its forward, `with torch.autocast('{f['device']}', enabled=False):` "
        "and cast its input with .float(); or train in bf16."),
    "loss_fp32": lambda f: (
        f"Compute the loss in FP32: on `.float()` logits under `torch.autocast('{f['device']}', enabled=False)`; or use the "
        "fused stable op: `F.binary_cross_entropy_with_logits` instead of sigmoid then log, `F.log_softmax` / "
        "`F.cross_entropy` instead of softmax then log (in FP16, sigmoid rounds to exactly 1.0 above ~8.3 "
        "and log(1 - p) is -inf)."),
    "bf16_target": lambda f: "Or switch to bf16 autocast (FP32's exponent range) if the device supports it: rerun with --target bf16.",
    "keep_fp32": lambda f: (
        f"Keep {first_layer(f)} in FP32: wrap its computation in `torch.autocast(device_type='{f['device']}', enabled=False)` "
        "and call it on `x.float()`."),
    "bf16_autocast": lambda f: (
        "Or switch to bf16 autocast (FP32's exponent range, no GradScaler needed) if the device supports it: "
        "rerun with --target bf16 to check."),
    "into_range": lambda f: (
        f"Or bring the values of {first_layer(f)} into range: normalise its input, scale before the product "
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
        f"The gradients are tiny (largest {g3(f['largest_grad'])}): scale the loss up (normalise by fewer tokens), "
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
    "spec_model": lambda f: (
        "Make the spec's build_model() build the run's model "
        f"({f['differs'][0][0] or 'the model'}: {f['differs'][0][1] or 'absent'} in the run), then replay the capture "
        "again; or replay without build_model() where the capture recorded how the model was built."),
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


from ampdoctor.report.words import compile as _compile  # noqa: E402 - the compile rung's words, merged in

FIXES.update(_compile.FIXES)
