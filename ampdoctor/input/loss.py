"""What "the model's loss" is, in one rule.

A model's output carries its loss as the output itself (a tensor), ``output["loss"]`` or
``output.loss``. The rule: that candidate is the loss when it is a tensor with exactly one element,
whatever its shape (``()``, ``(1,)``, ``(1, 1)``: a reduction that kept its dimensions is still one
number); the loss is then that element as a 0-dim tensor. Anything else (several elements, not a
tensor) is not a loss. The spec's triage (``engine.step.get_loss``), the replay of a captured forward
and the framework tap (``watch.tap.ForwardTap``) all read the loss by this rule.
"""

from __future__ import annotations

from typing import Any

import torch


def loss_candidate(output: Any) -> Any:
    """What the model's output offers as its loss: the output itself when it is a tensor, else
    ``output["loss"]`` or ``output.loss`` (None when it offers nothing)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", None)


def is_loss(value: Any) -> bool:
    """A tensor with exactly one element (any shape)."""
    return isinstance(value, torch.Tensor) and value.numel() == 1


def model_loss(output: Any) -> torch.Tensor | None:
    """The model's own loss as a 0-dim tensor (see the module's rule), or None when its output carries none."""
    loss = loss_candidate(output)
    return loss.reshape(()) if is_loss(loss) else None


__all__ = ["is_loss", "loss_candidate", "model_loss"]
