"""Replay one step's forward and backward in a stage's precision to find the first non-finite autograd node.

The triage stages record gradients at module boundaries; ``judge.gradnode`` looks inside them. This runs it on one
batch from given weights, in the stage's own precision (autocast, or the model's ``.half()`` copy), the loss times
the GradScaler scale the step ran at. Once, at diagnosis time.
"""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor.engine.forward import forward_loss
from ampdoctor.input.batches import to_device
from ampdoctor.input.spec import Spec
from ampdoctor.judge.gradnode import GradNode, first_nonfinite_grad
from ampdoctor.ladder import FP32, registered, rung


def replay_grad_node(model: nn.Module, spec: Spec, batch: object, state: dict[str, torch.Tensor], stage: str,
                     device: torch.device, scale: float = 1.0) -> GradNode | None:
    """Forward, loss and ``(loss * scale).backward()`` of one batch in ``stage``'s precision from ``state``
    ('initial': FP32); the first autograd node whose output gradient is non-finite."""
    model.load_state_dict(state)
    model.train()
    prec = rung(stage) if stage in registered() else FP32  # ('initial': the FP32 start)
    run_model = prec.cast_model(model, device)
    b = to_device(batch, device)
    try:
        return first_nonfinite_grad(run_model, lambda: forward_loss(run_model, b, spec.loss_fn, prec)[1], scale)
    finally:
        model.zero_grad(set_to_none=True)
