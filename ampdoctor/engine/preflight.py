"""Checks of what the spec built, before any stage runs: each failure is a SpecError saying what to fix.

A stage treats an exception in user code as data (it may be an FP16 effect). These checks catch what
is broken in FP32 already, so that it is refused with one line instead of diagnosed as a model bug.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import BatchError, SpecError
from ampdoctor.input.batches import Batches, describe_layout, layout, to_device
from ampdoctor.input.spec import Spec, call_user, check_optimizer, where

MAX_LAYOUTS = 8
"""Batch layouts (shapes but the first dimension, dtypes) besides the first batch's that get an FP32 forward."""


def initial_weights(model: nn.Module, path: Path) -> None:
    """NaN or Inf in a parameter, or NaN in a buffer, before any step: a corrupt checkpoint or init.

    Buffers may hold Inf on purpose (a -inf attention mask), never NaN.
    """
    bad: list[str] = []
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if not t.is_floating_point():
                continue
            t = t.detach()
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum()) if kind == "parameter" else 0
            if nan or inf:
                what = " and ".join(x for x in (f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else "") if x)
                bad.append(f"{kind} {name} ({what})")
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise SpecError(
            f"{path.name}: build_model() returned weights that are already non-finite: {', '.join(bad[:3])}{more}; "
            "the checkpoint or the initialisation is corrupt (check torch.isfinite on the state dict), "
            "so no precision can train it"
        )


def optimizer(spec: Spec, model: nn.Module, what: str = "build_optimizer()") -> None:
    """Build the spec's optimizer once over the model's parameters and check what comes back."""
    from ampdoctor.engine.forward import make_optimizer, optimizer_argument

    if spec.build_optimizer is None:
        if spec.build_scheduler is not None:
            scheduler(spec, make_optimizer(None, model))  # over the default optimizer the stages build
        return

    opt = call_user(spec.build_optimizer, optimizer_argument(spec.build_optimizer, model), what=what, path=spec.path)
    check_optimizer(opt, what, spec.path)
    own = {id(p) for p in model.parameters()}
    held = [p for g in opt.param_groups for p in g.get("params", [])]
    if not any(id(p) in own for p in held):
        raise SpecError(f"{spec.path.name}: {what} returned an optimizer that holds none of the model's parameters "
                        f"({len(held)} of its own); build it over what it is given, e.g. "
                        "`def build_optimizer(params): return torch.optim.AdamW(params, lr=1e-3)`")
    scheduler(spec, opt)


def scheduler(spec: Spec, opt: torch.optim.Optimizer) -> None:
    """Build the spec's ``build_scheduler(optimizer)`` once over a throwaway optimizer and step it once: it
    must return a scheduler (something with ``step()``) whose step works, or it is one line now instead of
    a traceback (or a model_bug verdict) in every stage."""
    if spec.build_scheduler is None:
        return
    import warnings

    what = "build_scheduler(optimizer)"
    sched = call_user(spec.build_scheduler, opt, what=what, path=spec.path)
    if not callable(getattr(sched, "step", None)):
        raise SpecError(f"{spec.path.name}: {what} returned {type(sched).__name__}, not an LR scheduler; return one "
                        "over the optimizer it is given, e.g. `return torch.optim.lr_scheduler.StepLR(optimizer, 10)`")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'lr_scheduler.step() before optimizer.step()': this one is a trial
        call_user(sched.step, what="the scheduler's step()", path=spec.path)


def batches_run(spec: Spec, model: nn.Module, batches: Batches, device: torch.device) -> None:
    """One FP32 forward + loss on the first batch (with autograd: the loss must reach the weights)
    and, without autograd, on the first batch of each other layout; the model's state is put back."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # a forward may move BatchNorm statistics
    name = spec.path.name
    try:
        loss = _forward(spec, model, batches.items[0], device, grad=True, index=0)
        if not loss.is_floating_point():
            raise SpecError(f"{name}: the loss has dtype {str(loss.dtype).replace('torch.', '')}; return a "
                            "floating-point loss (e.g. cross_entropy on logits), not a count or an argmax")
        if not loss.requires_grad:
            raise SpecError(f"{name}: the loss does not depend on the trainable weights (it has no grad_fn); "
                            "compute it from the model's output, outside torch.no_grad(), without .item() or .detach()")
        del loss
        first = layout(batches.items[0])
        seen = {first}
        for i, b in enumerate(batches.items):
            lay = layout(b)
            if lay in seen:
                continue
            seen.add(lay)
            if len(seen) > MAX_LAYOUTS + 1:
                break
            _forward(spec, model, b, device, grad=False, index=i,
                     differs=f"; batch {i} holds {describe_layout(b)} where batch 0 holds {describe_layout(batches.items[0])}")
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)


def _forward(spec: Spec, model: nn.Module, batch: Any, device: torch.device, *, grad: bool, index: int,
             differs: str = "") -> torch.Tensor:
    from ampdoctor.engine.forward import forward_loss

    try:
        with torch.set_grad_enabled(grad):
            return forward_loss(model, to_device(batch, device), spec.loss_fn)[1]
    except BatchError as e:  # --batch-keys names a field the batch does not hold
        raise SpecError(f"{spec.path.name}: {e}") from None
    except SystemExit as e:
        raise SpecError(f"{where(e, spec.path)}: the model or loss_fn called sys.exit({'' if e.code is None else repr(e.code)}) "
                        "on a batch; ampdoctor runs them itself, so raise an exception (or return) instead of exiting") from None
    except Exception as e:
        which = "the first batch" if index == 0 else f"batch {index}"
        raise SpecError(
            f"{spec.path.name}: {which} does not run in FP32 ({type(e).__name__}: {str(e).strip()[:200]}){differs}"
            + ("; yield batches of one layout (only the first dimension, the batch size, may change)" if differs else
               _how_called(spec, model, batch))
        ) from None


def _how_called(spec: Spec, model: nn.Module, batch: Any) -> str:
    """What ampdoctor made of the batch and how to say otherwise: '; ampdoctor called model(batch['image']) and
    loss_fn(output, batch['label']); name the fields with --batch-keys ...'."""
    from ampdoctor.input.batches import KeyedLoss, describe_call

    keyed = spec.loss_fn if isinstance(spec.loss_fn, KeyedLoss) else None
    keys = keyed.keys if keyed is not None else None
    try:
        call = describe_call(batch, model, keys)
    except BatchError:
        call = ""
    if not call:
        return "; a batch is model(inputs) + loss_fn(output, targets) for (inputs, targets), model(**batch) for a dict"
    if spec.loss_fn is None or (keyed is not None and keyed.loss_fn is None):
        call = call.split(" and loss_fn(")[0] + " and took the model's own loss"
    fields = [str(k) for k in batch] if isinstance(batch, dict) else [str(i) for i in range(len(batch))]
    example = f"{','.join(fields[:-1])}:{fields[-1]}" if len(fields) > 1 else "image:label"
    return (f"; ampdoctor called {call}: to choose the fields, give --batch-keys IN[,IN...]:TARGET "
            f"(e.g. --batch-keys {example}, or \"batch_keys\" in TRIAGE_OPTIONS)")
