"""Shared pieces of the zoo specs (imported by the spec files, which live next to it)."""

import torch
from torch import nn


class ScaledMatmul(torch.autograd.Function):
    """A custom Function with no custom_fwd/custom_bwd: under autocast its backward mixes dtypes."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.transpose(-2, -1) @ x


class CustomLinear(nn.Module):
    """Drop-in for an nn.Linear, through ScaledMatmul."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight = lin.weight
        self.bias = lin.bias

    def forward(self, x):
        y = ScaledMatmul.apply(x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)
        return y + self.bias if self.bias is not None else y


class LogRelu(nn.Module):
    """A precision-independent bug: log(relu(x)) is log(0) = -inf for x <= 0, in FP32 too."""

    def forward(self, x):
        return torch.log(torch.relu(x))


def mask_grad_hooks(model: nn.Module) -> None:
    """The "NaN guard" that hides overflows from GradScaler."""
    for p in model.parameters():
        p.register_hook(lambda g: torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0))


def hand_bce(logits, target):
    """Binary cross-entropy written by hand: sigmoid rounds to 1.0 in FP16 above ~8.3."""
    p = torch.sigmoid(logits)
    return -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()
