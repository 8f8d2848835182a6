"""What a rule reads and the outcomes rules share: ``Ctx`` (the stage results, batches, config, the FP32 re-check
and the figures worked out from them once), the injected checks (``Recheck``, ``HookCheck``), GradScaler's story
in the run's steps (``scaler_story``), and the two outcomes several rules return (``amp_defeated``,
``update_swallowed``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from ampdoctor.input.batches import Batches
from ampdoctor.input.config import TriageConfig
from ampdoctor.judge.gradnode import GradNode
from ampdoctor.judge.measures import calibration_steps, first_bad_step, mean_swallowed, stall_ratio, underflowing_params
from ampdoctor.judge.opscan import MaskedRows, NonfiniteOp, OpRecord
from ampdoctor.judge.scale_facts import Advice, ScaleFacts
from ampdoctor.judge.scaler import diagnose_scale
from ampdoctor.judge.thresholds import SKIP_RATE_ALERT, STALL_RATIO
from ampdoctor.records import Finding, Fix, Outcome, ScaleEvent, ScalerStory, StageResult, StepStats, UserHook
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
        growth_probe | isolated: its normal working; see capture.trigger.FailingStep)."""
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
        calib = set(calibration_steps(self.tgt)) if self.tgt_name == "amp" else set()
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
        bad = first_bad_step(tgt, amp=self.tgt_name == "amp")
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


def amp_defeated(c: Ctx, step: int | None, ev: dict[str, Any], why: dict[str, Any]) -> Outcome:
    """AMP itself is defeated: ``why["why"]`` names how (damaged | probe_clean | nonfinite_weights | masked | stall)."""
    ev = dict(ev)
    if c.hooks:
        ev["hooks"] = c.hooks
    fix = Fix("let_scaler_see", {"hooks": c.hooks}) if c.hooks else Fix("check_amp_recipe")
    facts = {"variant": "amp_defeated", "step": step, "hooks": c.hooks, **why}
    return Outcome("amp_misuse", None, step, "amp", facts,
                   [Finding("amp_misuse", "error", stage="amp", step=step, evidence=ev)], [fix])


def update_swallowed(c: Ctx, step: int | None) -> Outcome:
    tgt = c.tgt
    assert tgt is not None
    sw = mean_swallowed(tgt)
    ev: dict[str, Any] = {"lost_update_share": sw, "optimizer_constants_underflowing": tgt.optimizer_underflow}
    facts = {"variant": "swallowed", "step": step, "optimizer_underflow": list(tgt.optimizer_underflow), "lost_share": sw}
    return Outcome("fp16_update_swallowed", None, step, "fp16", facts,
                   [Finding("fp16_update_swallowed", "error", stage="fp16", step=step, evidence=ev)], [Fix("master_weights")])
