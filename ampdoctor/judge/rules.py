"""From stage results to a verdict, findings and fixes, as data. No I/O; the FP32 re-check is injected.

Each rule is a small function over the records (``Ctx``: stage results, batches, config, the FP32
re-check) that returns an ``Outcome`` (cause, module, step, stage, facts, findings, fixes) or None
when it does not apply; ``RULES`` is their order and the first Outcome decides. No rule writes
English: ``ampdoctor.report.words`` turns causes, finding codes and fix codes into sentences.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Literal

import numpy as np

from ampdoctor.fmt import pow2
from ampdoctor.formats import FP16
from ampdoctor.input.batches import Batches, absmax_ratio, check_batch, fields, outlier_ratio
from ampdoctor.input.config import TriageConfig
from ampdoctor.judge import locate
from ampdoctor.judge.datascan import DataIssue, largest_beyond, scan_batches, typical_magnitudes
from ampdoctor.judge.gradnode import GradNode
from ampdoctor.judge.opscan import MaskedRows, NonfiniteOp, OpRecord, first_overflowing_op
from ampdoctor.judge.progress import loss_window
from ampdoctor.judge.refine import masked_facts, refine
from ampdoctor.judge.scaler import Advice, ScaleFacts, diagnose_scale, first_explosion
from ampdoctor.judge.thresholds import FLUSH_THRESHOLD, MIN_STALL_STEPS, OUTLIER_RATIO, SKIP_RATE_ALERT, STALL_RATIO
from ampdoctor.records import (
    Col,
    Finding,
    Fix,
    LayerRow,
    Outcome,
    ScaleEvent,
    ScalerStory,
    StageError,
    StageResult,
    StepStats,
    UserHook,
    nonfinite,
)
from ampdoctor.records import stats_at as _stats_at


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
    masked: Callable[[str], MaskedRows | None] | None = None
    """Replays the same FP32 forward and returns the first softmax inside a named module with a row masked
    throughout (softmax over all -inf is NaN in every precision)."""
    grad_node: Callable[[float], GradNode | None] | None = None
    """Replays the step's forward and backward in the stage's own precision from the same weights, the loss times the
    scale given, and returns the first autograd node whose output gradient is non-finite (``judge.gradnode``)."""
    masked_beyond: Callable[[str], MaskedRows | None] | None = None
    """Like ``masked``, for rows finite in FP32 and beyond FP16's range throughout (a -1e9 mask: -inf in FP16)."""


RecheckFn = Callable[[str, int], Recheck | None]


@dataclass
class HookCheck:
    """A step applied with a non-finite or exploding gradient norm, replayed from the weights before it at the loss
    scale it ran at: the parameters whose scaled gradients are non-finite with the user's gradient hooks on
    (``kept``: GradScaler sees these) and with them off (``stripped``: what backward made)."""

    step: int
    scale: float
    kept: list[str]
    stripped: list[str]


HookCheckFn = Callable[[str, int], HookCheck | None]


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


def stall_ratio(target: StageResult, fp32: StageResult) -> float | None:
    """How much of FP32's loss progress the target makes over the same steps (1: as much, 0: none).

    Both stages start from the same weights and see the same batch at every step, so the
    comparison is step by step: ``(head32 - tail_t) / (head32 - tail32)``, where head is the mean
    loss over the first quarter of the steps and tail over the last quarter (means over a window
    damp the batch-to-batch noise). None when FP32 made no meaningful progress (under 1% of its
    head) or there are too few steps to tell.
    """
    w = loss_window(target, fp32, MIN_STALL_STEPS)  # the windows, kept for the words
    return w.ratio if w is not None else None


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


def scaler_story(res: StageResult, cfg: TriageConfig, step0: int = 0,
                 resumed: bool = False, batches: Batches | None = None) -> tuple[ScalerStory, ScaleFacts] | None:
    """GradScaler's history in the amp stage, every step the run's own (``step0 + k``: the words are written
    from these numbers, never patched afterwards); ``resumed``: the stage started from the run's GradScaler
    state (a capture, a checkpoint), so the story starts from that scale, not ``--init-scale``. The story's
    explanation is left empty: ``report.words`` writes it from the facts."""
    recs = res.records
    if not recs or recs[0].scaler_scale is None:
        return None
    scales = [float(r.scaler_scale or 0.0) for r in recs]
    skipped = [r.skipped for r in recs]
    init = scales[0] if resumed else cfg.init_scale
    d = diagnose_scale(scales, skipped, growth_interval=cfg.growth_interval,
                       backoff_factor=cfg.backoff_factor, init_scale=init, steps=[step0 + r.step for r in recs],
                       nonfinite=[r.skip_reason == "nonfinite_loss" for r in recs])
    if batches is not None and batches.cycled and step0 == 0:
        d.advice = [_by_batch(a, d.later_skips, batches) for a in d.advice]
    events = [ScaleEvent(step0 + r.step, float(r.scaler_scale or 0.0), r.skip_reason) for r in recs if r.skipped]
    return ScalerStory(init, d.final_scale, d.min_scale, max(scales), d.calibration_skips, events, d.pattern, ""), d


def _by_batch(a: Advice, later: list[int], batches: Batches) -> Advice:
    """The isolated skips of a cycled dataloader grouped by the batch each step replayed: a batch that fails each time
    it comes round is one batch, said once ("batch 0, seen at steps 0, 8, 16 ...")."""
    if a.code != "check_isolated_skips":
        return a
    groups: dict[int, list[int]] = {}
    for s in later:
        groups.setdefault(batches.index(s), []).append(s)
    if all(len(v) == 1 for v in groups.values()):
        return a
    return replace(a, batches=tuple((b, tuple(v)) for b, v in groups.items()))


class Ctx:
    """What every rule reads: the stage results and inputs, and the measurements derived from them
    once (the FP32 re-check of the first bad step runs at most once, on first use)."""

    def __init__(self, results: dict[str, StageResult], batches: Batches, cfg: TriageConfig, recheck: RecheckFn,
                 device: str = "cpu", hooks: list[str] | None = None, scaler_phase: str | None = None,
                 step0: int = 0, resumed: bool = False, hook_list: list[UserHook] | None = None,
                 hook_check: HookCheckFn | None = None, captured: tuple[str, int] | None = None) -> None:
        self.results, self.batches, self.cfg, self.recheck = results, batches, cfg, recheck
        self.captured = captured
        """A replayed capture: the run's reason for it and its step, replay-relative (None for a plain triage)."""
        self.device, self.hooks = device, list(hooks or [])
        self.hook_list = list(hook_list or [])
        """The user's gradient hooks as data (``watch.userhooks.found``); ``hooks`` is them in words."""
        self.hook_check = hook_check
        self.scaler_phase = scaler_phase or ""
        """A replayed capture: what GradScaler was doing at the captured skip in the run (calibration |
        growth_probe | isolated: its normal working; see engine.capture.FailingStep)."""
        self.fp32 = results["fp32"]
        self.tgt_name = "amp" if cfg.target == "amp" else cfg.target
        self.tgt = results.get(self.tgt_name)
        self.probe = results.get("fp16")
        told = scaler_story(results["amp"], cfg, step0, resumed, batches) if "amp" in results else None
        self.story: ScalerStory | None = told[0] if told is not None else None
        self.scale: ScaleFacts | None = told[1] if told is not None else None

    @cached_property
    def ratio(self) -> float | None:
        return stall_ratio(self.tgt, self.fp32) if self.tgt is not None else None

    @property
    def stalled(self) -> bool:
        return self.ratio is not None and self.ratio < STALL_RATIO

    @property
    def collapsed(self) -> bool:
        return self.story is not None and self.story.pattern == "collapsed"

    @cached_property
    def later_skips(self) -> list[int]:
        """Skipped steps of the target after GradScaler's calibration."""
        if self.tgt is None or self.story is None:
            return []
        calib = set(_calibration_steps(self.tgt)) if self.tgt_name == "amp" else set()
        return [s for s in self.tgt.skipped_steps if s not in calib]

    @property
    def skip_alert(self) -> bool:
        return bool(self.later_skips) and len(self.later_skips) / max(1, len(self.tgt.records if self.tgt else [])) > SKIP_RATE_ALERT

    @cached_property
    def bad(self) -> int | None:
        """The target's first faulty step; for amp, a collapsed scale or skips above the alert rate count."""
        tgt = self.tgt
        if tgt is None:
            return None
        bad = _first_bad_step(tgt, amp=self.tgt_name == "amp")
        if self.tgt_name == "amp" and bad is None and (self.collapsed or self.skip_alert):
            bad = self.later_skips[0] if self.later_skips else (tgt.skipped_steps[0] if tgt.skipped_steps else None)
        return bad

    @cached_property
    def st(self) -> StepStats | None:
        return _stats_at(self.tgt, self.bad) if self.tgt is not None and self.bad is not None else None

    @cached_property
    def rc(self) -> Recheck | None:
        return self.recheck(self.tgt_name, self.bad) if self.bad is not None else None

    @property
    def rc_ev(self) -> dict[str, Any]:
        rc = self.rc
        return {"fp32_recheck_loss": rc.loss, "fp32_recheck_finite": rc.finite, "fp32_recheck_weights": rc.weights} if rc else {}

    @cached_property
    def uf(self) -> list[tuple[str, float]]:
        return underflowing_params(self.tgt, self.fp32) if self.tgt is not None else []

    @property
    def plain_fp16_weights(self) -> bool:
        return self.tgt_name == "fp16" and self.tgt is not None and not self.tgt.master_weights


Rule = Callable[[Ctx], Outcome | None]


# 1. FP32 itself fails: data or a model bug ---------------------------------------------------------

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
    s = _first_bad_step(c.fp32, amp=False)
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
    s = _first_bad_step(c.fp32, amp=False)
    out = _outlier(c.batches, s) if s is not None else None
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
    s = _first_bad_step(c.fp32, amp=False)
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
    (``judge.scaler.explodes``) at or before the captured step, so the failure does not depend on the precision: the
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


# 2. the target stage ----------------------------------------------------------------------------

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
        out = _outlier(c.batches, s)
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
    probe_bad = _first_bad_step(c.probe, amp=False) if c.probe is not None and c.probe is not c.tgt else None
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
    return _amp_misuse(c, c.bad, c.rc_ev, {"why": "damaged"})


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
        amax = _module_absmax(ref, module)
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
    if c.tgt_name == "amp" and c.probe is not None and not _probe_grad_problem(c.probe):
        # the gradients fit FP16 unscaled and overflow only times the scale: GradScaler's own business,
        # unless something handles the scaled gradients (the evidence amp_misuse names)
        if c.hooks:
            return _amp_misuse(c, bad, c.rc_ev, {"why": "probe_clean"})
        if c.scaler_phase in ("calibration", "growth_probe", "backoff", "isolated") or not (c.collapsed or c.skip_alert):
            return _scaler_normal(c, bad, st, module)
    if module is None and c.probe is not None:
        pb = _first_bad_step(c.probe, amp=False)
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
        return _swallowed(c, bad)
    return _amp_misuse(c, bad, c.rc_ev, {"why": "nonfinite_weights"})


# 3. overflows that something hid from GradScaler, then silent stalls -------------------------------

def masked_overflow(c: Ctx) -> Outcome | None:
    """amp: a scaled gradient must overflow FP16, yet arrived at unscale_ as finite zeros."""
    if c.tgt_name != "amp" or c.tgt is None:
        return None
    masked = masked_overflows(c.tgt, c.fp32)
    if not masked:
        return None
    p, step, scaled = masked[0]
    ev = {"parameter": p, "fp32_grad_absmax_x_scale": scaled, "fp16_max": FP16.max, "progress_vs_fp32": c.ratio}
    return _amp_misuse(c, step, ev, {"why": "masked", "parameter": p, "scaled": scaled})


def stall(c: Ctx) -> Outcome | None:
    """The target makes under half of FP32's loss progress without any non-finite value."""
    tgt = c.tgt
    if tgt is None or not c.stalled:
        return None
    if c.plain_fp16_weights and (tgt.optimizer_underflow or _mean_swallowed(tgt) > 0.5):
        return _swallowed(c, None)
    if c.uf:
        return _underflow(c, c.uf)
    if c.tgt_name == "amp":
        return _amp_misuse(c, None, {"progress_vs_fp32": c.ratio}, {"why": "stall"})
    facts = {"variant": "stall", "stage": c.tgt_name, "ratio": c.ratio}
    return Outcome("fp16_grad_underflow", None, None, c.tgt_name, facts,
                   [Finding("fp16_grad_underflow", "error", stage=c.tgt_name, evidence={"progress_vs_fp32": c.ratio})])


def optimizer_underflow(c: Ctx) -> Outcome | None:
    """FP16 weights and optimizer state with an optimizer constant that rounds to 0 in FP16."""
    if c.plain_fp16_weights and c.tgt is not None and c.tgt.optimizer_underflow:
        return _swallowed(c, None)
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


def _module_flush(st: StepStats, ref: StepStats) -> dict[str, tuple[float, list[tuple[str, float]]]]:
    """Per module with parameters: the share of its own parameters' FP32-non-zero gradient elements that are zero in
    ``st`` (flushed), and each parameter's share; rows with a non-finite value in either stage are left out."""
    acc: dict[str, list[Any]] = {}
    for p, row in st.pgrad.items():
        r = ref.pgrad.get(p)
        if r is None or nonfinite(row) > 0 or nonfinite(r) > 0 or not row[Col.NUMEL]:
            continue
        live = float(row[Col.NUMEL] - r[Col.ZERO])  # FP32-non-zero elements
        if live <= 0:
            continue
        frac = locate.flushed_frac(row, r)
        a = acc.setdefault(p.rsplit(".", 1)[0] if "." in p else locate.MODEL, [0.0, 0.0, []])
        a[0] += frac * live
        a[1] += live
        a[2].append((p, frac))
    return {m: (a[0] / a[1], a[2]) for m, a in acc.items()}


def first_flushed_module(target: StageResult, fp32: StageResult) -> tuple[int, str, float, list[tuple[str, float]]] | None:
    """(step, module, flushed share, its parameters' shares): the first step at which a module's own parameter
    gradients are more than half flushed (non-zero in FP32 on the same step, zero in the target), and of those modules
    the first that backward reaches on that step."""
    for st in target.stats:
        ref = _stats_at(fp32, st.step)
        if ref is None:
            continue
        flushed = {m: v for m, v in _module_flush(st, ref).items() if v[0] > FLUSH_THRESHOLD}
        if flushed:
            rank = {m: i for i, m in enumerate(locate.backward_order(st))}
            m = min(flushed, key=lambda n: rank.get(n, 1 << 30))
            share, params = flushed[m]
            return st.step, m, share, sorted(params, key=lambda pv: -pv[1])
    return None


def hit_modules(target: StageResult, fp32: StageResult, step: int) -> int:
    """How many modules have more than half of their parameter gradients flushed at ``step``."""
    st, ref = _stats_at(target, step), _stats_at(fp32, step)
    if st is None or ref is None:
        return 0
    return sum(1 for v in _module_flush(st, ref).values() if v[0] > FLUSH_THRESHOLD)


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
    bad = _first_bad_step(bf16, amp=False)
    if bad is not None:
        return Fix("bf16_tried", {"variant": "nonfinite", "step": bad})
    return Fix("bf16_tried", {"variant": "clean", "steps": len(bf16.records), "ratio": stall_ratio(bf16, fp32)})


def _scaler_normal(c: Ctx, step: int | None, st: StepStats | None, module: str | None) -> Outcome:
    """``healthy``: the step overflowed FP16 only times GradScaler's scale and the scaler backed off, as it
    is built to; what it did, the module that overflowed at that scale, and the headroom left unscaled."""
    rec = c.tgt.records[min(step or 0, len(c.tgt.records) - 1)] if c.tgt is not None and c.tgt.records else None
    scale = float(rec.scaler_scale) if rec is not None and rec.scaler_scale else None
    absmax = None
    if module is not None and c.probe is not None:
        ps = _stats_at(c.probe, min(step or 0, len(c.probe.records) - 1))
        if ps is not None:
            absmax = _module_grad_absmax(ps, module)
    headroom = FP16.headroom_binades(absmax) if absmax else None
    facts = {"variant": "scaler_normal", "stage": "amp", "step": step, "module": module, "scale": scale,
             "phase": c.scaler_phase or "isolated", "absmax": absmax, "headroom": headroom}
    return Outcome("healthy", module, step, "amp", facts,
                   [Finding("scaler_normal", "info", stage="amp", module=module, step=step,
                            evidence={"scale": scale, "phase": facts["phase"], "grad_absmax_unscaled": absmax,
                                      "headroom_binades": headroom})], [])


def _module_grad_absmax(st: StepStats, module: str) -> float | None:
    """The largest |gradient| of the module's parameters in a step's statistics (None if none recorded)."""
    vals = [float(row[Col.ABSMAX]) for name, row in st.pgrad.items()
            if name == module or name.startswith(module + ".") or (module == locate.MODEL and "." not in name)]
    vals = [v for v in vals if math.isfinite(v)]
    return max(vals) if vals else None


def _amp_misuse(c: Ctx, step: int | None, ev: dict[str, Any], why: dict[str, Any]) -> Outcome:
    """AMP itself is defeated: ``why["why"]`` names how (damaged | probe_clean | nonfinite_weights | masked | stall)."""
    ev = dict(ev)
    if c.hooks:
        ev["hooks"] = c.hooks
    fix = Fix("let_scaler_see", {"hooks": c.hooks}) if c.hooks else Fix("check_amp_recipe")
    facts = {"variant": "amp_defeated", "step": step, "hooks": c.hooks, **why}
    return Outcome("amp_misuse", None, step, "amp", facts,
                   [Finding("amp_misuse", "error", stage="amp", step=step, evidence=ev)], [fix])


def _swallowed(c: Ctx, step: int | None) -> Outcome:
    tgt = c.tgt
    assert tgt is not None
    sw = _mean_swallowed(tgt)
    ev: dict[str, Any] = {"lost_update_share": sw, "optimizer_constants_underflowing": tgt.optimizer_underflow}
    facts = {"variant": "swallowed", "step": step, "optimizer_underflow": list(tgt.optimizer_underflow), "lost_share": sw}
    return Outcome("fp16_update_swallowed", None, step, "fp16", facts,
                   [Finding("fp16_update_swallowed", "error", stage="fp16", step=step, evidence=ev)], [Fix("master_weights")])


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
        pb = _first_bad_step(probe, amp=False)
        if pb is not None and probe.stats:
            out.append(Finding("probe_nonfinite", "warning", stage="fp16", step=pb, evidence={}))
        sw = _mean_swallowed(probe)
        if sw > 0.1:
            out.append(Finding("probe_swallowed", "warning", stage="fp16", evidence={"lost_update_share": sw}))
    thin = [(r.module, r.absmax_fp32, r.headroom_binades) for r in layer_table(c.results, tgt_name, 50)
            if r.kind == "activation" and r.headroom_binades < 1 and r.overflow_frac == 0]
    for m, amax, h in thin[:3]:
        out.append(Finding("thin_headroom", "warning", stage=tgt_name, module=m, evidence={"absmax": amax, "headroom_binades": h}))
    return out


def not_reproduced(manifest: dict[str, object], reproduced: int, replays: int, last: list[dict[str, float | None]],
                   precision: str, step0: int, device: str) -> Diagnosis | None:
    """A captured failure that the replay in the run's own precision, from the captured state, does not
    repeat: a transient (nondeterminism, a hardware fault), not a property of the weights and the batch.

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
        pb = _first_bad_step(probe, amp=False)
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


def _calibration_steps(res: StageResult) -> list[int]:
    """Skipped steps that brought GradScaler's scale to a new low (see scaler.diagnose_scale)."""
    scales = [float(r.scaler_scale or 0.0) for r in res.records]
    return [i for i, r in enumerate(res.records) if r.skipped and (i == 0 or scales[i] <= min(scales[:i]))]


def _outlier(batches: Batches, step: int) -> tuple[str, float, list[int]] | None:
    index = batches.index(step)
    for name, _ in fields(batches[step]):  # the cached ratio first; the samples only for an outlier
        if absmax_ratio(batches, name, index) >= OUTLIER_RATIO:
            r, samples = outlier_ratio(batches, name, index)
            return name, r, samples
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


# detectors the rules call: the loss, frozen parameters, a custom Function's dtype, the device's kernels, the data -----
#
# * ``loss_fault``: every module output of the step is finite, yet the loss is not: the NaN/Inf was made inside the
#   loss function (e.g. ``sigmoid`` rounds to exactly 1.0 in FP16, so ``log(1 - p)`` is -inf).
# * ``frozen_params``: most of a parameter's FP32-non-zero gradient elements are zero in the target (flushed, as
#   ``underflowing_params``) *and* its weights move less than ``STALL_RATIO`` of the distance they move in FP32: the
#   per-parameter form of the loss stall, which needs no loss progress from FP32.
# * ``custom_function_dtype``: backward raised inside a custom ``autograd.Function`` with a dtype error: its backward
#   received FP16 tensors under autocast next to FP32 ones.
# * ``device_limited``: the target raised because the device has no FP16 kernel for an op.
# * ``probe_on_flagged_batch``: the raw FP16 probe's first fault falls on a batch the data scan flagged.

@dataclass(frozen=True)
class LossFault:
    step: int
    loss: float


def loss_fault(res: StageResult, step: int, st: StepStats | None) -> LossFault | None:
    """The loss of ``step`` is non-finite while every module output of that step is finite."""
    if st is None or step >= len(res.records):
        return None
    loss = res.records[step].loss
    if math.isfinite(loss) or locate.forward_fault(st):
        return None
    return LossFault(step, loss)


@dataclass(frozen=True)
class Frozen:
    param: str
    module: str
    flushed: float
    """Median share of FP32-non-zero gradient elements that are zero in the target."""
    moved: float
    """Target's weight movement ‖w_end − w_0‖ as a share of FP32's over the same steps."""
    decayed: bool = False
    """Under weight decay, flushed at every step of the run: the decay moves it as far as in FP32, not learning."""


def frozen_params(target: StageResult, fp32: StageResult, underflowing: list[tuple[str, float]],
                  throughout: list[tuple[str, float]] | None = None) -> list[Frozen]:
    """Parameters from ``underflowing`` (already in backward order) that barely move against FP32.

    Weight decay moves every weight, learning or not, in both stages alike, so for a parameter under decay the
    movement cannot tell a frozen one: there, a gradient more than half flushed over the whole run
    (``throughout``: the median over every step, as ``underflowing_params`` over all steps) is the freeze."""
    if not target.moved or not fp32.moved or len(target.records) != len(fp32.records) or target.stopped:
        return []
    whole = dict(throughout or [])
    names = list(dict.fromkeys([p for p, _ in underflowing] + [p for p in whole if p in target.weight_decay]))
    flushed = dict(underflowing)
    out = []
    for p in names:
        d32, dt = fp32.moved.get(p), target.moved.get(p)
        if d32 is None or dt is None or not d32 > 0 or not math.isfinite(dt):
            continue
        module = p.rsplit(".", 1)[0] if "." in p else locate.MODEL
        if dt < STALL_RATIO * d32:
            out.append(Frozen(p, module, flushed.get(p, whole.get(p, 0.0)), dt / d32))
        elif p in target.weight_decay and p in whole:
            out.append(Frozen(p, module, whole[p], dt / d32, decayed=True))
    if throughout and target.stats:  # both lists are in backward order: keep it across them
        rank = {m: i for i, m in enumerate(locate.backward_order(target.stats[0]))}
        out.sort(key=lambda f: rank.get(f.module, 1 << 30))
    return out


@dataclass(frozen=True)
class CustomFunctionDtype:
    function: str
    module: str | None


_DTYPE_WORDS = ("dtype", "scalar type", "Half", "BFloat16", "c10::Half")


def custom_function_dtype(err: StageError) -> CustomFunctionDtype | None:
    """A dtype error raised in the backward of a custom autograd.Function."""
    if err.custom_function is None or not any(w in err.message for w in _DTYPE_WORDS):
        return None
    return CustomFunctionDtype(err.custom_function, err.module)


_NO_HALF_KERNEL = "not implemented for 'Half'"
_CPU_KERNEL_WORDS = ("primitive descriptor", "oneDNN")


KernelLimit = Literal["onednn_fp16", "no_half_kernel"]
"""A kernel the device lacks: oneDNN's FP16 primitive on the CPU (under amp or raw FP16), or torch's FP16 kernel."""


def kernel_limit(message: str, stage: str, device: str) -> KernelLimit | None:
    """The kernel an exception's message (torch's own words) says the device lacks, or None when it says no such thing."""
    if device.split(":")[0] == "cpu" and stage in ("amp", "fp16") and any(w in message for w in _CPU_KERNEL_WORDS):
        return "onednn_fp16"
    return "no_half_kernel" if _NO_HALF_KERNEL in message else None


def device_limited(err: StageError, stage: str, device: str) -> bool:
    """The target raised because the device has no FP16 kernel for an op (``kernel_limit``): a limit of the device,
    not a NaN cause (verdict ``inconclusive``)."""
    return kernel_limit(err.message, stage, device) is not None


def probe_on_flagged_batch(step: int, batch_of: Callable[[int], int], issues: list[DataIssue]) -> list[DataIssue]:
    """Data issues that explain the raw FP16 probe's first failure at ``step``: issues of that
    step's batch that no earlier step's batch also holds (the probe got through those)."""
    b = batch_of(step)
    earlier = {batch_of(s) for s in range(step)}
    return [d for d in issues if b in d.batches and not earlier & set(d.batches)]
