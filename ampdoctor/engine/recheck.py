"""The FP32 re-check and the hooks' check: a stage's step replayed from the weights before it (``judge.rules`` asks,
through the functions built here), and the first op of a forward that goes non-finite."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ampdoctor.engine.forward import forward_loss
from ampdoctor.engine.grad_replay import replay_grad_node
from ampdoctor.formats import FP16
from ampdoctor.input.batches import Batches, KeyedLoss, filter_kwargs, micro_batches, split, to_device
from ampdoctor.input.spec import Spec
from ampdoctor.judge.context import HookCheck, HookCheckFn, Recheck
from ampdoctor.judge.gradnode import GradNode
from ampdoctor.judge.opscan import MaskedRows, NonfiniteOp, OpRecord, first_nonfinite_op, masked_rows, scan_module
from ampdoctor.ladder import AMP, FP32, registered, rung
from ampdoctor.records import StageResult, UserHook
from ampdoctor.tensors import iter_tensors
from ampdoctor.watch import userhooks


def hook_check(model: nn.Module, spec: Spec, batches: Batches, results: dict[str, StageResult], device: torch.device,
               hooks: list[UserHook]) -> HookCheckFn:
    """``check(stage, step)``: the amp stage's step ``step`` (one applied with a non-finite or exploding gradient norm)
    replayed from the weights before it, with the loss scale it ran at, once with the user's gradient hooks and once
    without them: which parameters' scaled gradients GradScaler would have found non-finite only without them."""

    def check(stage: str, step: int) -> HookCheck | None:
        res = results.get(stage)
        if (stage != "amp" or not hooks or res is None or res.applied_snapshot is None or res.applied_step != step
                or step >= len(res.records) or res.records[step].scaler_scale is None):
            return None
        scale = float(res.records[step].scaler_scale or 1.0)
        names = {id(p): n for n, p in model.named_parameters()}

        def grads(strip: bool) -> list[str] | None:
            model.load_state_dict(res.applied_snapshot)  # type: ignore[arg-type]
            model.train()
            model.zero_grad(set_to_none=True)
            if res.applied_rng is not None:
                torch.set_rng_state(res.applied_rng)
            micro = micro_batches(batches[step])
            with contextlib.ExitStack() as stack:
                if strip:
                    stack.enter_context(userhooks.disabled(model))
                try:
                    for b in micro:
                        loss = forward_loss(model, to_device(b, device), spec.loss_fn, AMP)[1]
                        (loss.float() * (scale / len(micro))).backward()
                except Exception:
                    return None
            bad = [names[id(p)] for p in model.parameters()
                   if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            model.zero_grad(set_to_none=True)
            return bad

        kept, stripped = grads(strip=False), grads(strip=True)
        if kept is None or stripped is None:
            return None
        return HookCheck(step, scale, kept, stripped)

    return check


def recheck_fn(model: nn.Module, spec: Spec, batches: Batches, init_state: dict[str, torch.Tensor],
               results: dict[str, StageResult], device: torch.device, step0: int = 0,
               start: str = "initial"):  # noqa: ANN201
    """FP32 replay of a step's batch from the stages' start (``start`` names it: 'initial', 'the captured
    weights at step 120', 'checkpoint-130') or a stage's snapshot, named with the run's step (``step0 + k``)."""

    def run(stage: str, step: int) -> Recheck | None:
        if stage == "initial":
            state, label = init_state, start
        else:
            res = results.get(stage)
            if res is None or res.snapshot is None or res.snapshot_step != step:
                return None
            state, label = res.snapshot, f"stage {stage} before step {step0 + step}"
        model.load_state_dict(state)
        model.train()
        model.zero_grad(set_to_none=True)
        micro = micro_batches(batches[step])
        lv, worst, worst_abs = 0.0, micro[0], -1.0
        try:
            for b in micro:  # an accumulated step: each micro-batch's loss divided by their number
                loss = forward_loss(model, to_device(b, device), spec.loss_fn)[1] / len(micro)
                loss.backward()
                li = float(loss.detach())
                lv += li
                if not math.isfinite(li) or abs(li) > worst_abs:  # the op scan looks at the worst micro-batch
                    worst, worst_abs = b, math.inf if not math.isfinite(li) else abs(li)
        except Exception:
            return None
        keys = spec.loss_fn.keys if isinstance(spec.loss_fn, KeyedLoss) else None
        args, kwargs, target = split(to_device(worst, device), model, keys)
        grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        model.zero_grad(set_to_none=True)

        def ops(module: str) -> list[OpRecord]:
            model.load_state_dict(state)
            return scan_module(model, module, lambda: model(*args, **filter_kwargs(model, kwargs)))

        def nonfinite_op() -> NonfiniteOp | None:
            return replay_nonfinite_op(model, spec, worst, state, stage, device)

        def masked(module: str) -> MaskedRows | None:
            model.load_state_dict(state)
            return masked_rows(model, module, lambda: model(*args, **filter_kwargs(model, kwargs)))

        def grad_node(scale: float) -> GradNode | None:
            return replay_grad_node(model, spec, worst, state, stage, device, scale)

        def masked_beyond(module: str) -> MaskedRows | None:
            model.load_state_dict(state)
            return masked_rows(model, module, lambda: model(*args, **filter_kwargs(model, kwargs)), FP16.overflow_threshold)

        return Recheck(lv, math.isfinite(lv) and grads_ok, label, ops, nonfinite_op, masked, grad_node, masked_beyond)

    return run


def replay_nonfinite_op(model: nn.Module, spec: Spec, batch: object, state: dict[str, torch.Tensor], stage: str,
                       device: torch.device) -> NonfiniteOp | None:
    """Forward + loss of one batch in ``stage``'s precision from ``state``; the first op going non-finite."""
    model.load_state_dict(state)
    prec = rung(stage) if stage in registered() else FP32  # ('initial': the FP32 start)
    run_model = prec.cast_model(model, device)
    b = to_device(batch, device)
    info: dict[str, bool] = {}

    def run() -> None:
        out, loss = forward_loss(run_model, b, spec.loss_fn, prec)
        others = [t for t in iter_tensors(out) if t.is_floating_point() and t.data_ptr() != loss.data_ptr()]
        info["loss_only"] = not bool(torch.isfinite(loss)) and all(bool(torch.isfinite(t).all()) for t in others)

    op = first_nonfinite_op(run_model, run)
    if op is not None:
        op.loss_only = info.get("loss_only", False)
    return op
