"""From stage results to a verdict, findings and fixes, as data. No I/O; the FP32 re-check is injected.

Each rule is a small function over the records (``Ctx``: stage results, batches, config, the FP32
re-check) that returns an ``Outcome`` (cause, module, step, stage, facts, findings, fixes) or None
when it does not apply; ``RULES`` is their order and the first Outcome decides. No rule writes
English: ``ampdoctor.report.words`` turns causes, finding codes and fix codes into sentences.

This module is the verdict: ``RULES``, ``diagnose`` (stage results to a ``Diagnosis``), the healthy outcome and its
warnings, the data findings, and the shift of a replay's steps. The rules live by the group they judge:
``rules_fp32`` (FP32 itself fails), ``rules_target`` (the target stage fails), ``rules_silent`` (hidden
overflows, stalls, flushes); what they read in ``context`` (``Ctx``), ``measures`` and ``detectors``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ampdoctor.formats import FP16
from ampdoctor.input.batches import Batches
from ampdoctor.input.config import TriageConfig
from ampdoctor.judge import locate
from ampdoctor.judge.context import Ctx, HookCheckFn, RecheckFn, Rule
from ampdoctor.judge.datascan import DataIssue, scan_batches
from ampdoctor.judge.detectors import probe_on_flagged_batch
from ampdoctor.judge.measures import first_bad_step, layer_table, mean_swallowed, stall_ratio, underflowing_params
from ampdoctor.judge.progress import loss_window
from ampdoctor.judge.refine import refine
from ampdoctor.judge.rules_fp32 import (
    fp32_exploded,
    fp32_model_bug,
    fp32_nonfinite_data,
    fp32_outlier,
    fp32_raised,
    hook_hid_overflow,
)
from ampdoctor.judge.rules_silent import flushed_in_fp16, frozen, masked_overflow, optimizer_underflow, stall
from ampdoctor.judge.rules_target import (
    beyond_range_batch,
    custom_function,
    damaged_weights,
    forward_in_root,
    forward_overflow,
    grad_overflow,
    loss_in_fp16,
    no_target,
    nonfinite_weights,
    outlier_at_event,
    target_raised,
)
from ampdoctor.judge.scale_facts import ScaleFacts
from ampdoctor.judge.thresholds import MIN_STALL_STEPS
from ampdoctor.records import Finding, Fix, LayerRow, Outcome, ScalerStory, StageResult, UserHook


@dataclass
class Diagnosis:
    """The verdict as data: the deciding rule's Outcome (with the data scan's findings and every fix),
    the layer table, GradScaler's story. ``report.words`` writes the English when the Report is built."""

    outcome: Outcome
    layers: list[LayerRow]
    scaler: ScalerStory | None
    device: str = "cpu"
    scaler_note: str | None = None
    """'overflows_hidden': the scale history looks healthy only because GradScaler never saw the overflows."""
    scale: ScaleFacts | None = None
    """The amp stage's scale history as facts, in the run's steps (``scaler``'s explanation is written from them)."""


def healthy(c: Ctx) -> Outcome:
    """No rule applies: the target trains like FP32; the probes and the layer table add warnings."""
    story = c.story
    window = loss_window(c.tgt, c.fp32, MIN_STALL_STEPS) if c.tgt is not None else None
    facts = {"variant": "healthy", "stage": c.tgt_name, "ratio": c.ratio, "window": window,
             "calibration_skips": story.calibration_skips if story else 0}
    return Outcome("healthy", None, None, c.tgt_name, facts, warnings(c))


RULES: tuple[Rule, ...] = (
    fp32_raised, fp32_nonfinite_data, fp32_outlier, hook_hid_overflow, fp32_model_bug, fp32_exploded,
    no_target, custom_function, target_raised, outlier_at_event, beyond_range_batch,
    damaged_weights, forward_in_root, loss_in_fp16, forward_overflow, grad_overflow, nonfinite_weights,
    masked_overflow, stall, optimizer_underflow, frozen, flushed_in_fp16,
)
"""In order: the first rule that returns an Outcome decides the verdict; ``healthy`` when none does."""


def judge(c: Ctx) -> Outcome:
    """The first rule's Outcome, or the healthy one with its warnings."""
    for rule in RULES:
        out = rule(c)
        if out is not None:
            return out
    return healthy(c)


def diagnose(
    results: dict[str, StageResult],
    batches: Batches,
    cfg: TriageConfig,
    recheck: RecheckFn,
    device: str = "cpu",
    model_hooks: list[str] | None = None,
    scaler_phase: str | None = None,
    step0: int = 0,
    resumed: bool = False,
    hook_list: list[UserHook] | None = None,
    hook_check: HookCheckFn | None = None,
    captured: tuple[str, int] | None = None,
) -> Diagnosis:
    """Apply the rules in order (FP32 → target stage, with probes and the FP32 re-check → healthy),
    then add what every verdict carries: the layer table led by the verdict's module, the bf16
    stage's word on switching, and the data scan's findings."""
    c = Ctx(results, batches, cfg, recheck, device, model_hooks, scaler_phase, step0, resumed, hook_list, hook_check,
            captured)
    out = refine(c, _not_the_root(judge(c)))  # below the module: the autograd node, masked rows
    table = layer_table(results, c.tgt_name, focus=out.module) if out.module else layer_table(results, c.tgt_name)
    ev = out.findings[0].evidence if out.findings else {}
    if out.module and "op" in ev and "fp32_absmax" in ev:
        op_row = LayerRow(f"{out.module} > {ev['op']}", "op", float(ev["fp32_absmax"]), float(ev.get("op_overflow_frac", 0.0)),
                          0.0, 0.0, FP16.headroom_binades(float(ev["fp32_absmax"])), out.step)
        table = [op_row, *table]
    story = c.story
    # the history looks healthy only because the overflows never reached GradScaler
    note = "overflows_hidden" if out.cause == "amp_misuse" and story is not None and not story.skips else None
    if (out.facts.get("variant") in ("forward_in_code", "forward_overflow") and out.stage == "amp" and story is not None
            and story.skips):
        note = "forward_fault"  # the skips follow the non-finite forward values, not a search for the largest scale
    extra: list[Fix] = []
    if out.cause.startswith("fp16_") and "bf16" in results and cfg.target != "bf16":
        extra.append(bf16_check(results["bf16"], c.fp32))
    issues = scan_batches(batches)
    findings = [*out.findings, *data_findings(issues, out.findings, results, batches)]
    beyond = [d for d in issues if _beyond_fp16(d)]
    if beyond:  # a data-range finding, even when the target trained: FP16 cannot represent these values
        out.facts["beyond_fp16"] = {"field": beyond[0].field, "value": beyond[0].value, "batch": beyond[0].batches[0],
                                    "fields": len({d.field for d in beyond})}
    return Diagnosis(replace(out, findings=findings, fixes=[*out.fixes, *extra]), table, story, device, note, c.scale)


def _not_the_root(out: Outcome) -> Outcome:
    """``<model>`` is never the verdict's module (a user cannot act on it): a fault of the root's own code (outside
    every child) names no module; the facts and evidence keep what the rule found there (an op, a parameter)."""
    if out.module != locate.MODEL:
        return out
    if out.facts.get("module") == locate.MODEL:
        out.facts["module"] = None
    out.facts["in_root"] = True
    for f in out.findings:
        if f.module == locate.MODEL:
            f.module = None
    for fx in out.fixes:
        if fx.facts.get("module") == locate.MODEL:
            fx.facts["module"] = None
    return replace(out, module=None)


def shift_diagnosis(d: Diagnosis, offset: int) -> Diagnosis:
    """Number every step as the run did (a replay's step k is the run's step ``offset + k``): the
    verdict's step, the findings' steps, and every fact or fix fact whose key is ``step``, ``batch``
    or ends in ``_step``. A copy; the layer table and scaler story are shifted with the rest of the report."""
    if offset == 0:
        return d
    out = copy.deepcopy(d.outcome)
    if out.step is not None:
        out.step += offset
    _shift_facts(out.facts, offset)
    for f in out.findings:
        if f.step is not None:
            f.step += offset
    for fx in out.fixes:
        _shift_facts(fx.facts, offset)
    return replace(d, outcome=out)


def _shift_facts(facts: dict[str, Any], offset: int) -> None:
    for k, v in facts.items():
        # a replay feeds one batch a step: its batch k is the batch of the run's step offset + k
        if (k in ("step", "batch") or k.endswith("_step")) and isinstance(v, int) and not isinstance(v, bool):
            facts[k] = v + offset


def bf16_check(bf16: StageResult, fp32: StageResult) -> Fix:
    """What the bf16 stage of this very run says about switching to bf16."""
    if bf16.error is not None:
        return Fix("bf16_tried", {"variant": "raised", "type": bf16.error.type, "step": bf16.error.step,
                                  "message": bf16.error.message})
    bad = first_bad_step(bf16, amp=False)
    if bad is not None:
        return Fix("bf16_tried", {"variant": "nonfinite", "step": bad})
    return Fix("bf16_tried", {"variant": "clean", "steps": len(bf16.records), "ratio": stall_ratio(bf16, fp32)})


def warnings(c: Ctx) -> list[Finding]:
    """Warnings for a healthy verdict: GradScaler's calibration, flushed gradients, what the raw FP16
    probe shows, and module outputs close to FP16's max."""
    out: list[Finding] = []
    story, fp32, tgt_name = c.story, c.fp32, c.tgt_name
    if story and story.calibration_skips:
        out.append(Finding("calibration_skips", "info", stage="amp", step=0,
                           evidence={"scales": [e.scale for e in story.skips[: story.calibration_skips]],
                                     "_count": story.calibration_skips, "_init_scale": story.init_scale}))
    if c.uf:
        out.append(Finding("fp16_grad_underflow", "warning", stage=tgt_name, module=c.uf[0][0].rsplit(".", 1)[0],
                           evidence={"flushed": dict(c.uf[:10]), "_count": len(c.uf)}))
    probe = c.probe
    if probe is not None and tgt_name != "fp16":
        puf = underflowing_params(probe, fp32)
        if puf:
            out.append(Finding("probe_underflow", "warning", stage="fp16", module=puf[0][0].rsplit(".", 1)[0],
                               evidence={"flushed": {p: round(f, 4) for p, f in puf[:10]}, "_count": len(puf)}))
        pb = first_bad_step(probe, amp=False)
        if pb is not None and probe.stats:
            out.append(Finding("probe_nonfinite", "warning", stage="fp16", step=pb, evidence={}))
        sw = mean_swallowed(probe)
        if sw > 0.1:
            out.append(Finding("probe_swallowed", "warning", stage="fp16", evidence={"lost_update_share": sw}))
    thin = [(r.module, r.absmax_fp32, r.headroom_binades) for r in layer_table(c.results, tgt_name, 50)
            if r.kind == "activation" and r.headroom_binades < 1 and r.overflow_frac == 0]
    for m, amax, h in thin[:3]:
        out.append(Finding("thin_headroom", "warning", stage=tgt_name, module=m, evidence={"absmax": amax, "headroom_binades": h}))
    return out


def not_reproduced(manifest: dict[str, object], reproduced: int, replays: int, last: list[dict[str, float | None]],
                   precision: str, step0: int, device: str,
                   differs: Sequence[tuple[str, str, str]] = ()) -> Diagnosis | None:
    """A captured failure that the replay in the run's own precision, from the captured state, does not
    repeat: a transient (nondeterminism, a hardware fault), not a property of the weights and the batch.

    ``differs``: the modules whose settings differ between the run's model and the one the replay built
    (``input.origin.differences``: a dropout rate, an epsilon the weights' shapes do not show). Then the replay ran
    another model, and its clean steps say nothing of the run's: ``replay_mismatch``, never a transient.

    None when at least one replay failed again. ``step0`` is the run's number of the first replayed step;
    every step here counts from it (replay-relative), as the records do: ``shift_diagnosis`` adds it back.
    """
    if reproduced > 0:
        return None
    step = int(str(manifest.get("step", step0)))
    module = manifest.get("module")
    mod = str(module) if isinstance(module, str) else None
    ev: dict[str, Any] = {"captured_reason": manifest.get("reason"), "captured_loss": manifest.get("loss"),
                          "captured_grad_l2": manifest.get("grad_l2_pre_clip"), "captured_scale": manifest.get("scale"),
                          "replays": replays, "replays_failed": reproduced, "replay_results": last}
    rel = step - step0
    facts = {"variant": "not_reproduced", "step": rel, "reason": manifest.get("reason"), "precision": precision,
             "replays": replays, "losses": [x.get("loss") for x in last]}
    if differs:
        shown = [list(d) for d in differs[:3]]
        facts.update(variant="replay_mismatch", differs=shown, differs_count=len(differs))
        ev["differs"] = [list(d) for d in differs[:20]]
        return Diagnosis(Outcome("replay_mismatch", mod, rel, precision, facts,
                                 [Finding("replay_mismatch", "error", stage=precision, module=mod, step=rel, evidence=ev)],
                                 [Fix("spec_model", {"differs": shown})]), [], None, device)
    out = Outcome("not_reproduced", mod, rel, precision, facts,
                  [Finding("not_reproduced", "error", stage=precision, module=mod, step=rel, evidence=ev)], [Fix("transient")])
    return Diagnosis(out, [], None, device)


def data_findings(issues: list[DataIssue], findings: list[Finding], results: dict[str, StageResult],
                  batches: Batches) -> list[Finding]:
    """The data scan as findings (always), and whether the raw FP16 probe's failure follows the data."""
    named = {(f.step, f.evidence.get("field")) for f in findings if f.code == "data"}
    out = []
    for d in issues:
        if (d.batches[0], d.field) in named:
            continue
        ev: dict[str, Any] = {"kind": d.kind, "field": d.field, "batches": list(d.batches[:20]),
                              "samples": list(d.samples[:20]), "count": d.count, "typical_magnitude": d.typical}
        if d.kind != "nonfinite":
            ev["value"] = d.value
        ev["_issue"] = _issue_facts(d)
        out.append(Finding(f"data_{d.kind}", "warning", step=d.batches[0], evidence=ev))
    probe = results.get("fp16")
    if probe is not None:
        pb = first_bad_step(probe, amp=False)
        pb = probe.error.step if pb is None and probe.error is not None else pb
        if pb is not None and pb >= 1:  # the probe got through earlier batches, so the failure follows this one
            b = batches.index(pb)
            on = probe_on_flagged_batch(pb, batches.index, issues)
            if on:
                out.append(Finding("probe_follows_data", "warning", stage="fp16", step=pb,
                                   evidence={"batch": b, "kinds": sorted({d.kind for d in on}), "_issue": _issue_facts(on[0])}))
    return out


def _issue_facts(d: DataIssue) -> dict[str, Any]:
    """What the words say about a data issue (``report.words.data_issue``)."""
    ratio = abs(d.value) / d.typical if d.kind == "sentinel" else d.value / d.typical if d.kind == "outlier" else None
    return {"kind": d.kind, "field": d.field, "batch": d.batches[0], "batches": len(d.batches), "samples": list(d.samples[:10]),
            "count": d.count, "value": d.value, "typical": d.typical, "ratio": ratio, "beyond_fp16": _beyond_fp16(d)}


def _beyond_fp16(d: DataIssue) -> bool:
    """A finite value that becomes inf when cast to FP16 (|x| >= 65520), whatever else the scan calls it."""
    return d.kind != "nonfinite" and math.isfinite(d.value) and abs(d.value) >= FP16.overflow_threshold


