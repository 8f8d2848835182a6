"""The verdict's words: its summary by ``facts["variant"]`` (``SUMMARIES``, ``summary``; a healthy run's loss window
by ``describe``), and the deciding rule's finding: its title (``RULE_TITLES``) and its fix (``RULE_FINDING_FIX``,
``rule_fix``)."""

from __future__ import annotations

from collections.abc import Callable

from ampdoctor.fmt import gen, pct0
from ampdoctor.formats import FP16
from ampdoctor.judge.progress import LossWindow
from ampdoctor.records import Fix
from ampdoctor.report.words import inside
from ampdoctor.report.words.common import PHASES, Facts, custom_where, g3, g4, hooks_in, op_name
from ampdoctor.report.words.fixes import fix_text

_AMP_WHY: dict[str, Callable[[Facts], str]] = {
    "damaged": lambda f: "weights reached at this step fail in FP32 too: AMP let damaged updates through",
    "probe_clean": lambda f: "GradScaler keeps skipping while raw FP16 gradients (no scaling) stay finite",
    "nonfinite_weights": lambda f: "weights became non-finite with finite gradients",
    "masked": lambda f: (
        f"{f['parameter']}'s gradient times the loss scale is {g3(f['scaled'])}, beyond FP16's max, so it must "
        "overflow, yet it arrived at unscale_ as finite zeros: something replaced the infs, "
        "GradScaler never backed off and those gradients were dropped"),
    "stall": lambda f: "AMP's loss stalls against FP32 while raw FP16 shows no range problem",
}


def _amp_defeated(f: Facts) -> str:
    st = f" at step {f['step']}" if f.get("step") is not None else ""
    hooks = f.get("hooks") or []
    return (f"FP32 and raw FP16 train, but the amp stage fails{st}: {_AMP_WHY[f['why']](f)}"
            + (f" (hooks found: {hooks_in(hooks)})" if hooks else "") + ".")


def _hook_hid(f: Facts) -> str:
    applied = (f"so GradScaler saw no inf and applied the update (gradient norm {g4(f['norm'])}, FP32's "
               f"{g4(f['fp32_norm'])}, at loss scale {g3(f['scale'])})")
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


_CODE_WHAT = {
    "root": lambda f: f"{op_name(f)} in the model's own forward (outside every submodule)",
    "module": lambda f: f"{op_name(f)} inside {f['module']}",
    "loss": lambda f: f"{op_name(f)} in the loss function",
    "model_loss": lambda f: f"{op_name(f)} in the loss the model computes in its forward",
}


def _forward_overflow(f: Facts) -> str:
    amax = f.get("fp32_absmax")
    op_s = f"its {f['op']} op " if f.get("op") is not None else ""
    amax_s = f" ({op_s}reaches {g4(amax)} in FP32, above FP16's max {gen(FP16.max)})" if amax is not None and amax > FP16.max else ""
    rc = f.get("recheck_loss")
    return (f"In the {f['stage']} stage the output of {f.get('module') or 'the input cast'} becomes non-finite at step "
            f"{f['step']}{amax_s} while FP32 stays finite"
            + (f" (FP32 re-check of that step from the same weights: loss {g4(rc)})" if rc is not None else "") + ".")


def _grad_overflow(f: Facts) -> str:
    how = {"collapsed": lambda: f"GradScaler's scale collapsed to {g4(f['min_scale'])}",
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
             else f"over all {f['steps']} steps: its weights move only by weight decay ({g3(f['weight_decay'])}), "
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
    vs = (f", {g3(f['ratio'])}x the field's typical magnitude {g3(f['typical'])}" if f.get("ratio") else "")
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


def _scaler_normal(f: Facts) -> str:
    where = f" in {f['module']}" if f.get("module") else ""
    s = (f"GradScaler working as designed: at step {f['step']} the gradients{where} overflowed FP16 only times the "
         f"loss scale" + (f" {g3(f['scale'])}" if f.get("scale") else "") + f" (GradScaler was "
         f"{PHASES.get(str(f.get('phase')), 'backing off')}), it skipped the step and backed off, and raw FP16 "
         "without scaling stays finite.")
    if f.get("absmax") and f.get("headroom") is not None:
        s += (f" Unscaled, their largest value is {g3(f['absmax'])}: {g3(f['headroom'])} binade(s) of FP16 headroom, "
              "room for a scale up to about 2^" + f"{max(int(f['headroom']), 0)}.")
    return s


def _not_reproduced(f: Facts) -> str:
    got = ", ".join(f"loss {g4(lv)}" if lv is not None else "no step" for lv in f["losses"])
    return (f"The run failed at step {f['step']} ({f['reason']}), but replaying that step in {f['precision']} from "
            f"the captured weights, optimizer and scaler state, on the captured batch, finished cleanly {f['replays']} "
            f"times ({got}): the failure does not follow from the weights and the batch. It is a transient: "
            "nondeterminism or a hardware fault, not FP16 range.")


def _differs(f: Facts) -> str:
    """'transformer.h.0.attn.attn_dropout is Dropout(p=0.0, inplace=False) here and Dropout(p=0.2, inplace=False) in
    the run (and 9 more modules differ)'."""
    name, run, here = f["differs"][0]
    what = (f"{name or '<model>'} is {here or 'missing'} here and {run or 'missing'} in the run")
    more = int(f.get("differs_count", 1)) - 1
    return what + (f" (and {more} more module{'s' if more != 1 else ''} differ{'' if more != 1 else 's'})" if more else "")


def _replay_mismatch(f: Facts) -> str:
    got = ", ".join(f"loss {g4(lv)}" if lv is not None else "no step" for lv in f["losses"])
    return (f"The run failed at step {f['step']} ({f['reason']}); the replay in {f['precision']} finished cleanly "
            f"{f['replays']} times ({got}), but it did not run the run's model: {_differs(f)}. A replay of another "
            "model says nothing of the run's failure, transient or not.")


SUMMARIES: dict[str, Callable[[Facts], str]] = {
    "fp32_raised": lambda f: f"The FP32 reference raises {f['type']} at step {f['step']}: {f['message']}",
    "fp32_data_nonfinite": lambda f: (
        f"Batch {f['batch']} holds {f['count']} NaN/Inf value(s) in {f['field']} (samples {f['samples'][:10]}); "
        f"FP32 fails on it at step {f['step']}, so precision is not the cause."),
    "fp32_data_outlier": lambda f: (
        f"FP32 fails at step {f['step']} on batch {f['batch']}, whose field {f['field']!r} is {g3(f['ratio'])}x larger "
        "than the median batch."),
    "fp32_diverged": lambda f: (
        f"FP32 fails at step {f['step']} on finite data: batch {f['batch']} is finite and trains {_from_start(f)}, "
        f"so the weights diverged over {f['steps_before']} steps (largest gradient norm before: {g4(f['max_grad_l2'])})."),
    "fp32_bug": _fp32_bug,
    "fp32_exploded": lambda f: (
        f"FP32 diverges too: its update at step {f['step']} has a gradient norm of {g4(f['grad_l2'])}, "
        f"{g3(f['ratio'])}x the median of the {f['history']} applied steps before it (the Monitor's exploding update; "
        f"the run's failure was captured at step {f['captured_step']}), and its loss goes from {g4(f['first_loss'])} "
        f"to {g4(f['max_loss'])} with every value finite. The training diverges whatever the precision."),
    "no_target": lambda f: "FP32 trains cleanly; no target stage was run.",
    "custom_function": lambda f: (
        f"The backward of {custom_where(f)} raises {f['type']} at step {f['step']} ({f['message'][:120]}): under autocast it "
        "receives FP16 tensors next to FP32 ones, because the Function has no custom_fwd/custom_bwd."),
    "target_raised": lambda f: (
        f"The {f['stage']} configuration {'cannot run' if f['device_limit'] else 'breaks'} on {f['device']}: {f['type']} in "
        f"{f.get('module') or 'user code'} at step {f['step']} ({f['message'][:120]}). {f['hint']}"),
    "target_outlier": lambda f: (
        f"Step {f['step']} of the {f['stage']} stage fails on batch {f['batch']}, whose field {f['field']!r} is "
        f"{g3(f['ratio'])}x larger than the median batch: the failure follows the data."),
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
    "replay_mismatch": _replay_mismatch,
}
"""Verdict variant (``Outcome.facts["variant"]``) → the verdict's summary."""


def _code_title(f: Facts) -> str:
    if f["place"] == "root":
        return f"{op_name(f)} in the model's forward overflows FP16"
    if f["place"] == "module":
        return f"{f['module']} overflows FP16 in the forward pass"
    return f"the loss becomes non-finite in FP16 ({op_name(f)})"


RULE_TITLES: dict[str, Callable[[Facts], str]] = {
    "fp32_raised": lambda f: f"fp32 stage raised {f['type']} at step {f['step']}",
    "fp32_data_nonfinite": lambda f: f"batch {f['batch']} holds {f['count']} NaN/Inf value(s) in {f['field']}",
    "fp32_data_outlier": lambda f: f"batch {f['batch']} is an outlier ({f['field']} {g3(f['ratio'])}x the median)",
    "fp32_diverged": lambda f: f"FP32 fails at step {f['step']} on finite data",
    "fp32_bug": lambda f: f"FP32 fails at step {f['step']} on finite data",
    "fp32_exploded": lambda f: f"FP32's update explodes at step {f['step']} ({g3(f['ratio'])}x the recent gradient norm)",
    "custom_function": lambda f: f"{custom_where(f)} raises {f['type']} in backward under autocast",
    "target_raised": lambda f: f"{f['stage']} stage raised {f['type']} in {f.get('module') or 'user code'} at step {f['step']}",
    "target_outlier": lambda f: f"batch {f['batch']} is an outlier: {f['field']} is {g3(f['ratio'])}x the median batch",
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
    "replay_mismatch": lambda f: f"the replay's model is not the run's: {_differs(f)}",
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


def rule_fix(variant: str, facts: Facts, fixes: list[Fix]) -> str:
    if variant in RULE_FINDING_FIX:
        return RULE_FINDING_FIX[variant](facts)
    return fix_text(fixes[0]) if fixes else ""


def summary(facts: Facts) -> str:
    return SUMMARIES[facts["variant"]](facts) + inside.extra(facts)


def describe(w: LossWindow, name: str) -> str:
    """'mean loss over steps 36-47: amp 0.62, FP32 0.58, both down from FP32's 2.31 over steps 0-11 (107% of FP32's progress)'."""
    last = f"{w.steps - w.window}-{w.steps - 1}"
    return (f"mean loss over steps {last}: {name} {w.target_tail:.4g}, FP32 {w.fp32_tail:.4g}, from FP32's "
            f"{w.fp32_head:.4g} over steps 0-{w.window - 1}: {w.ratio:.0%} of FP32's progress")


from ampdoctor.report.words import compile as _compile  # noqa: E402 - the compile rung's words, merged in

SUMMARIES.update(_compile.SUMMARIES)
RULE_TITLES.update(_compile.RULE_TITLES)
