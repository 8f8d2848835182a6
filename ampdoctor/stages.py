"""One training stage (fp32 | fp16 | amp | bf16) over the cached batches, under Hooks.

Every stage follows the same recipe so that stages differ only in precision:
zero_grad(set_to_none) → forward (+ loss) → loss finiteness check → backward →
[unscale_] → global L2 norm (+ clip when max_norm is set) → step → [scaler.update()].
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampdoctor import locate
from ampdoctor.batches import Batches, cast_floating, filter_kwargs, split, to_device
from ampdoctor.blame import GraphRecorder
from ampdoctor.config import TriageConfig
from ampdoctor.formats import FP16
from ampdoctor.hooks import Hooks, StepStats, nonfinite
from ampdoctor.monitor import Monitor
from ampdoctor.spec import Spec
from ampdoctor.steplog import StepLogWriter

ProgressFn = Callable[[str, int], None]


@dataclass
class StepRecord:
    """One step of one stage: the step-log columns, plus what the stage measured."""

    step: int
    batch: int
    lr: float
    loss: float
    grad_l2_pre_clip: float
    grad_l2_post_clip: float
    skipped: bool
    skip_reason: str
    scaler_scale: float | None
    params_finite: bool = True
    update_swallowed_frac: float | None = None
    """fp16 stage: share of non-zero updates that FP16 weights would round away."""


@dataclass
class StageError:
    """An exception raised by user code (or an unsupported kernel) during a stage."""

    type: str
    message: str
    step: int
    module: str | None
    hint: str
    custom_function: str | None = None
    """Raised in the backward of this custom autograd.Function (its name), when it was one."""


@dataclass
class StageResult:
    name: str
    records: list[StepRecord] = field(default_factory=list)
    stats: list[StepStats] = field(default_factory=list)
    error: StageError | None = None
    stopped: str | None = None
    optimizer_underflow: list[str] = field(default_factory=list)
    """Optimizer constants that round to 0 in FP16 (e.g. 'eps=1e-08')."""
    master_weights: bool = True
    snapshot: dict[str, torch.Tensor] | None = None
    """FP32 weights before the first faulty step (target stage only), for the FP32 re-check."""
    snapshot_step: int | None = None
    moved: dict[str, float] = field(default_factory=dict)
    """‖w_end − w_0‖ per parameter over the steps run (the weights the optimizer stepped)."""

    @property
    def first_nonfinite_step(self) -> int | None:
        for r in self.records:
            if not math.isfinite(r.loss) or not math.isfinite(r.grad_l2_pre_clip) or not r.params_finite:
                return r.step
        return None

    @property
    def skipped_steps(self) -> list[int]:
        return [r.step for r in self.records if r.skipped]


def get_loss(output: Any, target: Any, loss_fn: Callable[..., Any] | None) -> torch.Tensor:
    """The scalar loss: loss_fn(output, target), or the model's own loss."""
    if loss_fn is not None:
        loss = loss_fn(output, target)
    elif isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    else:
        raise TypeError(
            f"the model returned {type(output).__name__} with no loss; define loss_fn(output, target) in the spec"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) in loss_fn")
    return loss.reshape(())


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def fp16_underflowing_constants(opt: torch.optim.Optimizer) -> list[str]:
    """Optimizer hyper-parameters that are non-zero but round to 0 in FP16."""
    out = []
    for g in opt.param_groups:
        for key in ("eps",):
            v = g.get(key)
            if isinstance(v, float) and 0 < abs(v) <= FP16.underflow_threshold:
                out.append(f"{key}={v:g}")
    return sorted(set(out))


class _Tracker:
    """Forward pre/post hooks that know which module is running, to name where an error came from."""

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.last_error_module: str | None = None
        names = {m: n or "<model>" for n, m in model.named_modules()}
        self.handles = []
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._enter(names[m])))
            self.handles.append(m.register_forward_hook(self._exit))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.stack.append(name)

        return hook

    def _exit(self, *_: Any) -> None:
        # hooks must return None, or they would replace the module's output
        if self.stack:
            self.stack.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


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


def _grad_norm(params: Sequence[torch.Tensor], max_norm: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Global L2 norm before and after clipping (both device scalars, no sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        z = torch.zeros((), dtype=torch.float32)
        return z, z
    norms = torch._foreach_norm(grads, 2.0)
    pre = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
    if max_norm is None:
        return pre, pre
    coef = torch.clamp(max_norm / (pre + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return pre, pre * coef


@contextlib.contextmanager
def _autocast(stage: str, device: torch.device) -> Iterator[None]:
    if stage == "amp":
        with torch.autocast(device.type, dtype=torch.float16):
            yield
    elif stage == "bf16":
        with torch.autocast(device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


def run_stage(name: str, ctx: StageContext) -> StageResult:
    """Run one stage from the initial weights; never raises for errors in user code."""
    cfg = ctx.config
    model = ctx.model
    model.load_state_dict(ctx.init_state)
    model.train()
    torch.manual_seed(cfg.seed)
    result = StageResult(name)
    pure_fp16 = name == "fp16" and cfg.target == "fp16"
    run_model = copy.deepcopy(model).half() if name == "fp16" else model
    master = list(model.parameters())
    run_params = list(run_model.parameters())
    build_opt = ctx.spec.build_optimizer or default_optimizer
    opt = build_opt(run_params if pure_fp16 else master)
    result.master_weights = not pure_fp16
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
        if name == "amp"
        else None
    )
    # the amp stage runs through the same Monitor users put in their own loops (its step order, skip
    # decision and GradScaler handling); the other stages record with the bare Hooks
    amp_mon = (Monitor(run_model, opt, scaler, max_norm=cfg.max_norm, weights=True, alert_min_steps=1 << 62)
               if scaler is not None and ctx.with_monitor else None)
    mon = Hooks(run_model) if ctx.with_monitor and amp_mon is None else None
    tracker = _Tracker(run_model)
    graph = GraphRecorder(run_model) if ctx.with_monitor else None  # the bare benchmark baseline runs without it
    step = 0
    prev: dict[str, torch.Tensor] | None = None
    snap_src: list[tuple[str, torch.Tensor]] = []
    try:
        if mon:
            mon.attach()
        for step in range(cfg.steps):
            if ctx.progress:
                ctx.progress(name, step)
            batch = to_device(ctx.batches[step], ctx.device)
            if name == "fp16":
                batch = cast_floating(batch, torch.float16)
            args, kwargs, target = split(batch)
            if ctx.snapshot and result.snapshot_step is None:
                # weights before this step, for the FP32 re-check; copied into the same buffers each step
                if prev is None:
                    snap_src = list(run_model.state_dict().items())
                    prev = {k: v.detach().float().clone() if v.is_floating_point() else v.clone() for k, v in snap_src}
                else:
                    torch._foreach_copy_(list(prev.values()), [v.detach() for _, v in snap_src])
            if mon:
                mon.begin_step(step)
            opt.zero_grad(set_to_none=True)
            if name == "fp16" and not pure_fp16:
                run_model.zero_grad(set_to_none=True)
            with _autocast(name, ctx.device):
                out = run_model(*args, **filter_kwargs(run_model, kwargs))
                loss = get_loss(out, target, ctx.spec.loss_fn)
            loss_finite = bool(torch.isfinite(loss))
            scale = float(scaler.get_scale()) if scaler else None
            lr = float(opt.param_groups[0].get("lr", float("nan")))
            skipped, reason = False, ""
            swallowed: torch.Tensor | None = None
            if amp_mon is not None:
                mrec = amp_mon.step(loss)
                pre = post = torch.zeros(())
                skipped, reason, scale = mrec.skipped, mrec.skip_reason, mrec.scaler_scale
            elif scaler is not None:
                # GradScaler sees the same non-finite gradients a user's loop would, so its
                # scale history is exactly what the user gets; the loss check names the reason.
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                if mon:
                    mon.after_backward()
                pre, post = _grad_norm(master, cfg.max_norm)
                scaler.step(opt)
                scaler.update()
                new_scale = float(scaler.get_scale())
                skipped = new_scale < scale if scale is not None else False
                if skipped:
                    reason = "nonfinite_loss" if not loss_finite else "nonfinite_grad"
            elif not loss_finite:
                # a plain loop would back-propagate NaN into the weights; nothing more to learn
                # from the backward, so record the step and stop after it
                pre = post = torch.tensor(float("nan"))
                skipped, reason = True, "nonfinite_loss"
            else:
                loss.backward()
                if name == "fp16" and not pure_fp16:
                    for p32, p16 in zip(master, run_params, strict=True):
                        p32.grad = None if p16.grad is None else p16.grad.float()
                if mon:
                    mon.after_backward()
                pre, post = _grad_norm(master if not pure_fp16 else run_params, cfg.max_norm)
                if name == "fp16" and not pure_fp16:
                    before = _flat(master)
                    opt.step()
                    swallowed = _swallowed_fraction(before, master)
                    with torch.no_grad():
                        for p32, p16 in zip(master, run_params, strict=True):
                            p16.copy_(p32)
                elif pure_fp16:
                    before = _flat(run_params)
                    grads = [p.grad for p in run_params]
                    opt.step()
                    swallowed = _lost_updates(before, run_params, grads)
                else:
                    opt.step()
            if amp_mon is not None:
                assert mrec.stats is not None
                st = mrec.stats
                result.stats.append(st)
                # weights after the update (the Monitor's rows hold the ones this step's forward used)
                params_finite = bool(torch.isfinite(torch.stack(torch._foreach_norm([p.detach() for p in master]))).all())
                pre_f, post_f, sw = mrec.grad_l2_pre_clip, mrec.grad_l2_post_clip, None
            elif mon:
                mon.after_step()
                mon.add_scalar("grad_l2_pre_clip", pre)
                mon.add_scalar("grad_l2_post_clip", post)
                if swallowed is not None:
                    mon.add_scalar("swallowed", swallowed)
                st = mon.end_step()
                result.stats.append(st)
                params_finite = all(nonfinite(r) == 0 for r in st.param.values())
                pre_f, post_f = st.extra["grad_l2_pre_clip"], st.extra["grad_l2_post_clip"]
                sw = st.extra.get("swallowed")
            else:
                params_finite = all(bool(torch.isfinite(p).all()) for p in run_params)
                pre_f, post_f = float(pre), float(post)
                sw = float(swallowed) if swallowed is not None else None
            if reason == "nonfinite_grad" and mon:
                where = locate.locate_backward(st)
                if where:
                    reason = f"nonfinite_grad:{where}"
            rec = StepRecord(step, ctx.batches.index(step), lr, float(loss.detach().float()), pre_f, post_f,
                             skipped, reason, scale, params_finite, sw)
            result.records.append(rec)
            if ctx.log is not None:
                ctx.log.write(rec)
            if ctx.snapshot and result.snapshot_step is None and (skipped or not params_finite or not loss_finite):
                result.snapshot, result.snapshot_step = prev, step
            if not params_finite:
                result.stopped = f"weights became non-finite at step {step}"
                break
            if not loss_finite and scaler is None:
                result.stopped = f"loss became non-finite at step {step}"
                break
    except Exception as e:  # user code failing is data, not a crash
        module = tracker.stack[-1] if tracker.stack else None
        bw = graph.blame(e) if module is None and graph is not None else None  # raised in backward: whose node raised
        result.error = StageError(type(e).__name__, str(e).strip().splitlines()[0][:300] if str(e).strip() else "",
                                  step, bw.module if bw else module, _error_hint(e, name, ctx.device),
                                  bw.custom_function if bw else None)
    finally:
        tracker.remove()
        if graph is not None:
            graph.remove()
        result.moved = weight_movement(run_model if pure_fp16 else model, ctx.init_state)
        if amp_mon is not None:
            amp_mon.close()
        if mon:
            mon.detach()
    return result


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
