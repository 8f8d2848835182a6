"""The forward and loss of one batch, and the spec's optimizer: what every step of ampdoctor's runs around the
recipe (``engine.step.TrainStep``), the triage replays and checks, the preflight and the dump's repro script."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampdoctor.input.batches import UNKNOWN_TARGET, KeyedLoss, cast_floating, filter_kwargs, split
from ampdoctor.input.loss import is_loss, loss_candidate, model_loss
from ampdoctor.input.rebuild import TrainingStepLoss
from ampdoctor.ladder import FP32, Rung
from ampdoctor.tensors import iter_tensors


def forward_probe(output: Any) -> torch.Tensor:
    """A stand-in loss for a forward whose targets are unknown (a ``ModelInputs`` batch): 0, or NaN when
    any floating output element is NaN/Inf (0 * inf is NaN), so the loss check sees a non-finite forward.
    Its gradients are zeros (or NaN through non-finite values): they say nothing of the real loss's."""
    parts = [t.float().sum() * 0.0 for t in iter_tensors(output) if t.is_floating_point()]
    if not parts:
        raise TypeError("the model returned no floating tensor; the replay of a captured forward needs one")
    return torch.stack(parts).sum()


def get_loss(output: Any, target: Any, loss_fn: Callable[..., Any] | None) -> torch.Tensor:
    """The scalar loss: loss_fn(output, target), or the model's own loss (``input.loss``: a one-element
    tensor, any shape, is the loss).

    With ``UNKNOWN_TARGET`` (a captured call of the model, its targets outside it): the model's own loss
    when its output carries one, else ``forward_probe`` (the forward alone is replayed)."""
    if target is UNKNOWN_TARGET:
        own = model_loss(output)
        return own if own is not None else forward_probe(output)
    loss = loss_fn(output, target) if loss_fn is not None else loss_candidate(output)
    if loss is None:
        raise TypeError(
            f"the model returned {type(output).__name__} with no loss; define loss_fn(output, target) in the spec"
        )
    if not is_loss(loss):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) in loss_fn")
    return loss.reshape(())  # type: ignore[no-any-return]


def batch_loss(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None) -> tuple[Any, torch.Tensor]:
    """(the model's output, the scalar loss) of one batch already on the device: ``model(inputs)`` (keyword
    inputs its forward does not take are left out: ``filter_kwargs``) then ``get_loss``; for a LightningModule's
    ``TrainingStepLoss``, its ``training_step`` on the whole batch (the output is the loss)."""
    if isinstance(loss_fn, TrainingStepLoss):
        loss = loss_fn.of(model, batch)
        return loss, loss
    keys = None
    if isinstance(loss_fn, KeyedLoss):  # --batch-keys: the fields the user named
        keys, loss_fn = loss_fn.keys, loss_fn.loss_fn
    args, kwargs, target = split(batch, model, keys)
    out = model(*args, **filter_kwargs(model, kwargs))
    return out, get_loss(out, target, loss_fn)


def forward_loss(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None,
                 rung: Rung = FP32) -> tuple[Any, torch.Tensor]:
    """The forward and the loss of one batch (already on the device) as ``rung`` computes them: its
    floating inputs cast to the rung's weight dtype, under its autocast; ``model`` runs as given (in the
    rung's weights: ``Rung.cast_model``). Every forward+loss of ampdoctor's goes through here: the
    recipe's, triage's replays and checks, the preflight and the dump's repro script."""
    if rung.low_weights:
        batch = cast_floating(batch, rung.params)
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    with rung.autocast_on(device):
        return batch_loss(model, batch, loss_fn)


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


MODEL_ARGS = ("model", "module", "net", "network")
NAMED_ARGS = ("named_parameters", "named_params")


def optimizer_argument(fn: Callable[..., Any], model: nn.Module) -> Any:
    """What a spec's ``build_optimizer`` takes, read from its first parameter: the model itself
    (``build_optimizer(model)``: decay / no-decay groups), ``named_parameters`` (a list of
    (name, parameter)), or else the list of parameters (``build_optimizer(params)``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    first = params[0] if params else None
    if first is not None:
        ann = first.annotation
        if first.name in MODEL_ARGS or ann is nn.Module or (isinstance(ann, str) and ann.split(".")[-1] == "Module"):
            return model
        if first.name in NAMED_ARGS:
            return list(model.named_parameters())
    return list(model.parameters())


def make_optimizer(fn: Callable[..., Any] | None, model: nn.Module) -> torch.optim.Optimizer:
    """The spec's optimizer over ``model`` (see ``optimizer_argument``), or AdamW(lr=1e-3)."""
    if fn is None:
        return default_optimizer(model.parameters())
    opt: torch.optim.Optimizer = fn(optimizer_argument(fn, model))
    return opt


__all__ = ["batch_loss", "default_optimizer", "forward_loss", "forward_probe", "get_loss", "make_optimizer",
           "optimizer_argument"]
