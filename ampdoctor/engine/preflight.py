"""Checks of what the spec built, before any stage runs: each failure is a SpecError saying what to fix.

A stage treats an exception in user code as data (it may be an FP16 effect). These checks catch what
is broken in FP32 already, so that it is refused with one line instead of diagnosed as a model bug.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import SpecError
from ampdoctor.input.batches import Batches, describe_layout, filter_kwargs, layout, split, to_device
from ampdoctor.input.spec import Spec, call_user, check_optimizer

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
    if spec.build_optimizer is None:
        return
    from ampdoctor.engine.step import optimizer_argument

    opt = call_user(spec.build_optimizer, optimizer_argument(spec.build_optimizer, model), what=what, path=spec.path)
    check_optimizer(opt, what, spec.path)


def batches_run(spec: Spec, model: nn.Module, batches: Batches, device: torch.device) -> None:
    """One FP32 forward + loss on the first batch (with autograd: the loss must reach the weights)
    and, without autograd, on the first batch of each other layout; the model's state is put back."""
    from ampdoctor.engine.step import get_loss

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # a forward may move BatchNorm statistics
    name = spec.path.name
    try:
        loss = _forward(spec, model, batches.items[0], device, grad=True, index=0, get_loss=get_loss)
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
            _forward(spec, model, b, device, grad=False, index=i, get_loss=get_loss,
                     differs=f"; batch {i} holds {describe_layout(b)} where batch 0 holds {describe_layout(batches.items[0])}")
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)


def _forward(spec: Spec, model: nn.Module, batch: Any, device: torch.device, *, grad: bool, index: int,
             get_loss: Any, differs: str = "") -> torch.Tensor:
    args, kwargs, target = split(to_device(batch, device))
    try:
        with torch.set_grad_enabled(grad):
            out = model(*args, **filter_kwargs(model, kwargs))
            return get_loss(out, target, spec.loss_fn)  # type: ignore[no-any-return]
    except Exception as e:
        which = "the first batch" if index == 0 else f"batch {index}"
        raise SpecError(
            f"{spec.path.name}: {which} does not run in FP32 ({type(e).__name__}: {str(e).strip()[:200]}){differs}"
            + ("; yield batches of one layout (only the first dimension, the batch size, may change)" if differs else
               "; a batch is model(inputs) + loss_fn(output, targets) for (inputs, targets), model(**batch) for a dict")
        ) from None
