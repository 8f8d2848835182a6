"""One triage stage, a rung of the precision ladder (``ampdoctor.ladder``: fp32 | fp16 | amp | bf16 | ...), over the
cached batches.

Every stage runs the one step recipe (``engine.step.TrainStep``) under the stage's rung, so stages differ
only in precision (and the rung's model transform); the stage adds what triage needs around it: the same initial
weights and seed, a snapshot of the weights before the first faulty step (for the FP32 re-check),
the FP16 lost-update share, and stopping once the weights are gone.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.engine.driver import Driver, Update
from ampdoctor.engine.forward import make_optimizer
from ampdoctor.engine.step import Measured, TrainStep
from ampdoctor.errors import OutputError, SpecError
from ampdoctor.formats import FP16
from ampdoctor.input.batches import Batches
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.rng import restore as restore_rng
from ampdoctor.input.spec import Spec, call_user, where
from ampdoctor.judge.detectors import kernel_limit
from ampdoctor.judge.explosion import EXPLODE_RATIO
from ampdoctor.ladder import Rung, rung
from ampdoctor.records import StageError, StageResult, StepRecord
from ampdoctor.report.stages import error_hint
from ampdoctor.watch import userhooks
from ampdoctor.watch.blame import GraphRecorder
from ampdoctor.watch.hooks import Hooks
from ampdoctor.watch.steplog import StepLogWriter
from ampdoctor.watch.tracker import ModuleTracker

ProgressFn = Callable[[str, int], None]


def fp16_underflowing_constants(opt: torch.optim.Optimizer) -> list[str]:
    """Optimizer hyper-parameters that are non-zero but round to 0 in FP16."""
    out = []
    for g in opt.param_groups:
        for key in ("eps",):
            v = g.get(key)
            if isinstance(v, float) and 0 < abs(v) <= FP16.underflow_threshold:
                out.append(f"{key}={v:g}")
    return sorted(set(out))


@dataclass
class StageContext:
    spec: Spec
    model: nn.Module
    """The FP32 model; its state is reset to ``init_state`` before every stage."""
    init_state: dict[str, torch.Tensor]
    batches: Batches
    config: TriageConfig
    device: torch.device
    progress: ProgressFn | None = None
    with_monitor: bool = True
    track: bool = True
    """Follow which module runs (errors name it). False with ``with_monitor=False``: nothing of ampdoctor's on the model
    (a compiled model: a hook would be traced into its graph and change what Inductor fuses)."""
    snapshot: bool = False
    log: StepLogWriter | None = None
    """Step log (the CSV of ``ampdoctor scaler``), written and flushed as each step finishes."""
    optimizer_state: dict[str, Any] | None = None
    """Replay: the captured optimizer state every stage starts from (else a fresh optimizer)."""
    scaler_state: dict[str, Any] | None = None
    """Replay: the captured GradScaler state the amp stage starts from (else ``config``'s settings)."""
    rng: dict[str, Any] | None = None
    """Replay: the run's RNG states, set before every stage instead of ``config.seed`` (``input.rng.restore``)."""
    rng_restored: list[str] | None = None
    """Filled with the RNG states that were set (``input.rng.restore``)."""
    probe_hooks: bool = False
    """Read the gradient each of the user's gradient hooks is handed, before it runs (``watch.userhooks.Probe``):
    ``StageResult.hook_inputs_nonfinite``."""
    ref_norms: list[float] | None = None
    """The FP32 stage's gradient norm at each step (same weights at the start, same batches): a target step applied
    with a norm ``EXPLODE_RATIO`` times FP32's, or a non-finite one, keeps a snapshot (``StageResult.applied_snapshot``)."""


@dataclass
class _Stage:
    """What one stage trains and watches, built by ``_build``."""

    run_model: nn.Module
    """The model the forward runs: the FP32 model, or an FP16 copy (fp16)."""
    master: list[torch.nn.Parameter] | None
    """FP32 master weights (fp16 with master weights): the FP32 model's parameters."""
    driver: Driver
    hooks: Hooks | None
    tracker: ModuleTracker
    graph: GraphRecorder | None
    probe: userhooks.Probe | None


def _start(prec: Rung, ctx: StageContext, result: StageResult) -> tuple[nn.Module, nn.Module | None]:
    """The stage's start: the initial weights and seed (or the run's RNG); the model the rung runs, and the FP32
    model when it holds the master weights (a copy in a lower weight dtype runs the forward)."""
    model = ctx.model
    model.load_state_dict(ctx.init_state)
    model.train()
    torch.manual_seed(ctx.config.seed)
    restored = restore_rng(ctx.rng)  # the run's own draws (dropout, a timestep drawn in the step), over the seed
    if ctx.rng_restored is not None:
        ctx.rng_restored[:] = restored
    result.master_weights = prec.master
    run_model = prec.cast_model(model, ctx.device)
    return run_model, model if prec.low_weights and prec.master else None


def _build(prec: Rung, ctx: StageContext, result: StageResult) -> _Stage:
    """The stage's model, optimizer (the spec's, over what this stage trains), scheduler, GradScaler, hooks and
    recipe, from the initial weights."""
    cfg = ctx.config
    run_model, master_of = _start(prec, ctx, result)
    master = list(master_of.parameters()) if master_of is not None else None
    # the spec's optimizer over what this stage trains: the FP32 master (fp32, amp, bf16, fp16 with master
    # weights) or the FP16 model itself (pure FP16); build_optimizer may take the model or named parameters
    owner = ctx.model if master is not None or run_model is ctx.model else run_model
    opt = make_optimizer(ctx.spec.build_optimizer, owner)
    sched = (call_user(ctx.spec.build_scheduler, opt, what="build_scheduler(optimizer)", path=ctx.spec.path)
             if ctx.spec.build_scheduler is not None else None)
    if ctx.optimizer_state is not None:
        opt.load_state_dict(copy.deepcopy(ctx.optimizer_state))  # state cast to the parameters' dtype
    pname = {id(p): n for n, p in owner.named_parameters()}
    result.weight_decay = {pname[id(p)]: float(g.get("weight_decay") or 0.0) for g in opt.param_groups for p in g["params"]
                           if id(p) in pname and float(g.get("weight_decay") or 0.0) > 0}
    if prec.params == torch.float16:  # raw FP16 weights: the optimizer's constants too
        result.optimizer_underflow = fp16_underflowing_constants(opt)
    scaler = (torch.amp.GradScaler(ctx.device.type, init_scale=cfg.init_scale, growth_factor=cfg.growth_factor,
                                   backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval)
              if prec.scaler else None)
    if scaler is not None and ctx.scaler_state is not None:
        scaler.load_state_dict(dict(ctx.scaler_state))
    hooks = Hooks(run_model, track=True) if ctx.with_monitor else None
    tracker = hooks.tracker if hooks is not None else ModuleTracker(run_model)
    assert tracker is not None
    graph = GraphRecorder(run_model) if ctx.with_monitor else None  # the bare benchmark baseline runs without it
    # without a scaler a stage does what a plain loop does: it applies whatever its gradients hold
    recipe = TrainStep(run_model, opt, scaler, precision=prec, hooks=hooks, max_norm=cfg.max_norm, master=master,
                       skip_nonfinite=scaler is not None, scheduler=sched)
    driver = Driver(recipe, ctx.spec.loss_fn, ctx.device, stop_at_nonfinite_loss=scaler is None, check_weights=True)
    if prec.params == torch.float16:
        driver.update = _lost_updates_of(recipe, master, list(run_model.parameters()))
    probe = userhooks.Probe(run_model) if ctx.probe_hooks else None
    return _Stage(run_model, master, driver, hooks, tracker, graph, probe)


def _lost_updates_of(recipe: TrainStep, master: list[torch.nn.Parameter] | None,
                     run_params: list[torch.nn.Parameter]) -> Update:
    """The fp16 stage's update: each applied step also measures the share of its update FP16 weights lose (with
    FP32 master weights: the share FP16 storage would round away; pure FP16: the weights it left unchanged)."""

    def update(m: Measured) -> float | None:
        if m.skip and recipe.skip_nonfinite:
            recipe.apply(m)
            return None
        trained = master if master is not None else run_params
        before = _flat(trained)
        grads = [p.grad for p in run_params]
        recipe.apply(m)
        return float(_swallowed_fraction(before, trained) if master is not None else _lost_updates(before, run_params, grads))

    return update


class _Snapshots:
    """The target stage's copies of the weights before a step, for the FP32 re-check: before the first faulty
    step (``StageResult.snapshot``) and before the first step applied with an exploding or non-finite gradient
    norm (``StageResult.applied_snapshot``, with the RNG state it began with)."""

    def __init__(self, ctx: StageContext, result: StageResult, run_model: nn.Module) -> None:
        self.on, self.ref, self.result, self.run_model = ctx.snapshot, ctx.ref_norms, result, run_model
        self.prev: dict[str, torch.Tensor] | None = None
        self.rng_before: torch.Tensor | None = None
        self.src: list[tuple[str, torch.Tensor]] = []

    def before(self) -> None:
        res = self.result
        if not (self.on and (res.snapshot_step is None or res.applied_step is None)):
            return
        self.rng_before = torch.get_rng_state()
        # weights before this step, for the FP32 re-check; copied into the same buffers each step
        if self.prev is None:
            self.src = list(self.run_model.state_dict().items())
            self.prev = {k: v.detach().float().clone() if v.is_floating_point() else v.clone() for k, v in self.src}
        else:
            torch._foreach_copy_(list(self.prev.values()), [v.detach() for _, v in self.src])

    def after(self, step: int, rec: StepRecord) -> None:
        res, prev = self.result, self.prev
        if not self.on or prev is None:
            return
        if res.applied_step is None and not rec.skipped and _exploded(rec.grad_l2_pre_clip, self.ref, step):
            res.applied_snapshot = {k: v.clone() for k, v in prev.items()}  # (prev is reused for the other snapshot)
            res.applied_step, res.applied_rng = step, self.rng_before
        if res.snapshot_step is None and (rec.skipped or not rec.params_finite or not math.isfinite(rec.loss)):
            # (a copy while prev is still refreshed each step for the applied snapshot)
            res.snapshot = prev if res.applied_step is not None else {k: v.clone() for k, v in prev.items()}
            res.snapshot_step = step


def run_stage(stage: Rung | str, ctx: StageContext) -> StageResult:
    """Run one stage (a rung, or a registered rung's name) from the initial weights through the driver; never raises
    for errors in user code."""
    prec = stage if isinstance(stage, Rung) else rung(stage, ctx.config)
    name = prec.name
    result = StageResult(name)
    st = _build(prec, ctx, result)
    driver, probe = st.driver, st.probe
    snaps = _Snapshots(ctx, result, st.run_model)

    def before(step: int) -> None:
        if ctx.progress:
            ctx.progress(name, step)
        snaps.before()

    try:
        if probe is not None:
            probe.attach()
        if st.hooks is not None or ctx.track:
            (st.hooks or st.tracker).attach()
        for done in driver.steps(ctx.config.steps, ctx.batches.__getitem__, ctx.batches.index, before):
            rec = done.record
            if done.stats is not None:
                result.stats.append(done.stats)
            result.records.append(rec)
            seen = probe.take() if probe is not None else None
            if seen:
                result.hook_inputs_nonfinite[rec.step] = seen
            if ctx.log is not None:
                ctx.log.write(rec)
            snaps.after(rec.step, rec)
        result.stopped = driver.stop
    except OutputError:  # the step log could not be written (a full disk): ampdoctor's own output, not data
        raise
    except SystemExit as e:  # the user's model, loss or scheduler exited: refuse in one line (not data, not exit 3)
        raise SpecError(f"{where(e, ctx.spec.path)}: your code called sys.exit({'' if e.code is None else repr(e.code)}) "
                        f"at step {driver.at} of stage {name}; ampdoctor runs it itself, so raise an exception instead of exiting") from None
    except Exception as e:  # user code failing is data, not a crash
        result.error = _stage_error(e, name, ctx.device, driver.at, st)
    finally:
        _detach(st)
        result.moved = weight_movement(st.run_model if st.master is None else ctx.model, ctx.init_state)
    return result


def _stage_error(e: Exception, name: str, device: torch.device, step: int, st: _Stage) -> StageError:
    """The exception as data: where it was raised (the module running, or whose backward node raised), with the hint
    its kind takes (``judge.detectors.kernel_limit``)."""
    module = st.tracker.current
    bw = st.graph.blame(e) if module is None and st.graph is not None else None  # raised in backward: whose node raised
    hint = error_hint(kernel_limit(str(e), name, device.type))  # (a device without the op's FP16 kernel: say so)
    return StageError(type(e).__name__, str(e).strip().splitlines()[0][:300] if str(e).strip() else "",
                      step, bw.module if bw else module, hint, bw.custom_function if bw else None)


def _detach(st: _Stage) -> None:
    if st.graph is not None:
        st.graph.remove()
    if st.probe is not None:
        st.probe.detach()
    (st.hooks or st.tracker).detach()


def _exploded(norm: float, ref: list[float] | None, step: int) -> bool:
    """An applied update whose gradient norm is non-finite (every element finite: GradScaler saw no inf) or
    ``EXPLODE_RATIO`` times FP32's norm of the same step."""
    if math.isnan(norm):
        return False
    if not math.isfinite(norm):
        return True
    r = ref[step] if ref is not None and step < len(ref) else math.nan
    return math.isfinite(r) and r > 0 and norm >= EXPLODE_RATIO * r


def weight_movement(model: nn.Module, init_state: dict[str, torch.Tensor]) -> dict[str, float]:
    """‖w − w_0‖ per parameter (L2, in FP32), w_0 in the parameter's own dtype."""
    out = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            w0 = init_state.get(n)
            if w0 is not None and w0.shape == p.shape:
                # from the stage's own start: FP16 weights start at the FP16 rounding of w_0
                out[n] = float(torch.linalg.vector_norm(p.detach().float() - w0.to(p.device, p.dtype).float()))
    return out


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in ts]) if ts else torch.zeros(0)


def _swallowed_fraction(before: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    """Share of non-zero FP32 updates that would vanish if the weights were stored in FP16.

    ``before`` is the flat FP32 weights before the step; a few kernels over all weights at once.
    """
    delta = _flat(after) - before
    nz = delta != 0
    w16 = before.half()
    same = (w16.float() + delta).half() == w16
    return (same & nz).sum().double() / nz.sum().clamp(min=1)


def _lost_updates(before: torch.Tensor, after: Sequence[torch.Tensor], grads: list[torch.Tensor | None]) -> torch.Tensor:
    """Pure FP16: share of weights with a non-zero gradient that the step left unchanged."""
    keep = [i for i, g in enumerate(grads) if g is not None]
    sizes = [t.numel() for t in after]
    b = torch.cat([part for i, part in enumerate(before.split(sizes)) if i in set(keep)]) if keep else before[:0]
    a = _flat([after[i] for i in keep])
    g = _flat([gi for gi in (grads[i] for i in keep) if gi is not None])
    has = (g != 0) & torch.isfinite(g)
    return ((a == b) & has).sum().double() / has.sum().clamp(min=1)
