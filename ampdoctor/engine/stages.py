"""One triage stage (fp32 | fp16 | amp | bf16) over the cached batches.

Every stage runs the one step recipe (``engine.step.TrainStep``) under the stage's precision policy,
so stages differ only in precision; the stage adds what triage needs around it: the same initial
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

from ampdoctor.engine.step import TrainStep, make_optimizer, stage_precision
from ampdoctor.errors import OutputError, SpecError
from ampdoctor.formats import FP16
from ampdoctor.input.batches import Batches, micro_batches, to_device
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.rng import restore as restore_rng
from ampdoctor.input.spec import Spec, call_user, where
from ampdoctor.judge.scaler import EXPLODE_RATIO
from ampdoctor.records import StageError, StageResult, StepRecord
from ampdoctor.watch import userhooks
from ampdoctor.watch.blame import GraphRecorder
from ampdoctor.watch.hooks import Hooks, ModuleTracker
from ampdoctor.watch.steplog import StepLogWriter

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


def _error_hint(e: BaseException, stage: str, device: torch.device) -> str:
    msg = str(e)
    if device.type == "cpu" and stage in ("amp", "fp16") and ("primitive descriptor" in msg or "oneDNN" in msg):
        return (
            "oneDNN has no FP16 kernel for this op on the CPU: a device limitation, not a NaN cause. "
            "Run triage with --device cuda, or keep this module in FP32 under autocast(enabled=False)."
        )
    if "not implemented for 'Half'" in msg:
        return "this op has no FP16 kernel on this device: a device limitation, not a NaN cause."
    return "the stage stopped at this exception; fix it and rerun (the other stages still ran)."


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


def run_stage(name: str, ctx: StageContext) -> StageResult:
    """Run one stage from the initial weights through ``TrainStep``; never raises for errors in user code."""
    cfg = ctx.config
    model = ctx.model
    model.load_state_dict(ctx.init_state)
    model.train()
    torch.manual_seed(cfg.seed)
    restored = restore_rng(ctx.rng)  # the run's own draws (dropout, a timestep drawn in the step), over the seed
    if ctx.rng_restored is not None:
        ctx.rng_restored[:] = restored
    result = StageResult(name)
    prec = stage_precision(name, cfg.target)
    low = prec.weights != torch.float32
    run_model = copy.deepcopy(model).to(prec.weights) if low else model
    master = list(model.parameters()) if low and prec.master else None
    run_params = list(run_model.parameters())
    # the spec's optimizer over what this stage trains: the FP32 master (fp32, amp, bf16, fp16 with master
    # weights) or the FP16 model itself (pure FP16); build_optimizer may take the model or named parameters
    opt = make_optimizer(ctx.spec.build_optimizer, model if master is not None or not low else run_model)
    sched = (call_user(ctx.spec.build_scheduler, opt, what="build_scheduler(optimizer)", path=ctx.spec.path)
             if ctx.spec.build_scheduler is not None else None)
    if ctx.optimizer_state is not None:
        opt.load_state_dict(copy.deepcopy(ctx.optimizer_state))  # state cast to the parameters' dtype
    owner = model if master is not None or not low else run_model
    pname = {id(p): n for n, p in owner.named_parameters()}
    result.weight_decay = {pname[id(p)]: float(g.get("weight_decay") or 0.0) for g in opt.param_groups for p in g["params"]
                           if id(p) in pname and float(g.get("weight_decay") or 0.0) > 0}
    result.master_weights = prec.master
    if name == "fp16":
        result.optimizer_underflow = fp16_underflowing_constants(opt)
    scaler = (
        torch.amp.GradScaler(
            ctx.device.type,
            init_scale=cfg.init_scale,
            growth_factor=cfg.growth_factor,
            backoff_factor=cfg.backoff_factor,
            growth_interval=cfg.growth_interval,
        )
        if prec.loss_scaling
        else None
    )
    if scaler is not None and ctx.scaler_state is not None:
        scaler.load_state_dict(dict(ctx.scaler_state))
    hooks = Hooks(run_model, track=True) if ctx.with_monitor else None
    tracker = hooks.tracker if hooks is not None else ModuleTracker(run_model)
    assert tracker is not None
    graph = GraphRecorder(run_model) if ctx.with_monitor else None  # the bare benchmark baseline runs without it
    # without a scaler a stage does what a plain loop does: it applies whatever its gradients hold
    recipe = TrainStep(run_model, opt, scaler, precision=prec, hooks=hooks, max_norm=cfg.max_norm, master=master,
                       skip_nonfinite=scaler is not None, scheduler=sched)
    step = 0
    prev: dict[str, torch.Tensor] | None = None
    rng_before: torch.Tensor | None = None
    snap_src: list[tuple[str, torch.Tensor]] = []
    probe = userhooks.Probe(run_model) if ctx.probe_hooks else None
    try:
        if probe is not None:
            probe.attach()
        if hooks is not None:
            hooks.attach()
        else:
            tracker.attach()
        for step in range(cfg.steps):
            if ctx.progress:
                ctx.progress(name, step)
            batch = to_device(ctx.batches[step], ctx.device)
            if ctx.snapshot and (result.snapshot_step is None or result.applied_step is None):
                rng_before = torch.get_rng_state()
                # weights before this step, for the FP32 re-check; copied into the same buffers each step
                if prev is None:
                    snap_src = list(run_model.state_dict().items())
                    prev = {k: v.detach().float().clone() if v.is_floating_point() else v.clone() for k, v in snap_src}
                else:
                    torch._foreach_copy_(list(prev.values()), [v.detach() for _, v in snap_src])
            if hooks is not None:
                hooks.begin_step(step)
            micro = micro_batches(batch)
            bad_loss: torch.Tensor | None = None
            for i, b in enumerate(micro):  # gradient accumulation: each micro-batch's loss divided by their number
                loss = recipe.forward(b, ctx.spec.loss_fn, zero_grad=i == 0)
                if len(micro) > 1:
                    loss = loss / len(micro)
                if scaler is None and not bool(torch.isfinite(loss)):
                    bad_loss = loss
                    break
                recipe.backward(loss)
            if bad_loss is not None:
                loss = bad_loss
                # a plain loop would back-propagate NaN into the weights; nothing more to learn from
                # the backward, so record the step (its forward statistics) and stop after it
                st = hooks.end_step() if hooks is not None and hooks.recording else None
                if st is not None:
                    result.stats.append(st)
                lr = opt.param_groups[0].get("lr", float("nan"))
                rec = StepRecord(step, ctx.batches.index(step), float(lr), float(loss.detach().float()), math.nan, math.nan,
                                 True, "nonfinite_loss", None, True, None)
            else:
                m, _ = recipe.measure(None)  # the step's loss: the sum over its micro-batches
                swallowed = None
                if name == "fp16" and not (m.skip and recipe.skip_nonfinite):
                    trained = master if master is not None else run_params
                    before = _flat(trained)
                    grads = [p.grad for p in run_params]
                    recipe.apply(m)
                    swallowed = float(_swallowed_fraction(before, trained) if master is not None
                                      else _lost_updates(before, run_params, grads))
                else:
                    recipe.apply(m)
                if m.stats is not None:
                    result.stats.append(m.stats)
                skipped = m.skip and recipe.skip_nonfinite
                rec = StepRecord(step, ctx.batches.index(step), float(m.lr if m.lr is not None else math.nan), m.loss,
                                 m.grad_l2_pre_clip, m.grad_l2_post_clip, skipped, m.reason if skipped else "", m.scale,
                                 recipe.weights_finite(), swallowed)
            result.records.append(rec)
            if probe is not None:
                seen = probe.take()
                if seen:
                    result.hook_inputs_nonfinite[step] = seen
            if ctx.log is not None:
                ctx.log.write(rec)
            loss_finite = math.isfinite(rec.loss)
            if (ctx.snapshot and result.applied_step is None and prev is not None and not rec.skipped
                    and _exploded(rec.grad_l2_pre_clip, ctx.ref_norms, step)):
                result.applied_snapshot = {k: v.clone() for k, v in prev.items()}  # (prev is reused for the other snapshot)
                result.applied_step, result.applied_rng = step, rng_before
            if ctx.snapshot and result.snapshot_step is None and (rec.skipped or not rec.params_finite or not loss_finite):
                # (a copy while prev is still refreshed each step for the applied snapshot)
                result.snapshot = (prev if result.applied_step is not None or prev is None
                                   else {k: v.clone() for k, v in prev.items()})
                result.snapshot_step = step
            if not rec.params_finite:
                result.stopped = f"weights became non-finite at step {step}"
                break
            if not loss_finite and scaler is None:
                result.stopped = f"loss became non-finite at step {step}"
                break
    except OutputError:  # the step log could not be written (a full disk): ampdoctor's own output, not data
        raise
    except SystemExit as e:  # the user's model, loss or scheduler exited: refuse in one line (not data, not exit 3)
        raise SpecError(f"{where(e, ctx.spec.path)}: your code called sys.exit({'' if e.code is None else repr(e.code)}) "
                        f"at step {step} of stage {name}; ampdoctor runs it itself, so raise an exception instead of exiting") from None
    except Exception as e:  # user code failing is data, not a crash
        module = tracker.current
        bw = graph.blame(e) if module is None and graph is not None else None  # raised in backward: whose node raised
        result.error = StageError(type(e).__name__, str(e).strip().splitlines()[0][:300] if str(e).strip() else "",
                                  step, bw.module if bw else module, _error_hint(e, name, ctx.device),
                                  bw.custom_function if bw else None)
    finally:
        if graph is not None:
            graph.remove()
        if probe is not None:
            probe.detach()
        result.moved = weight_movement(run_model if master is None and low else model, ctx.init_state)
        if hooks is not None:
            hooks.detach()
        else:
            tracker.detach()
    return result


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
