"""A custom autograd.Function without custom_fwd/custom_bwd breaks in backward under autocast.

``ScaledMatmul`` saves its FP32 weight, but under autocast its input and incoming gradient are
FP16: ``grad @ weight.t()`` mixes Half and Float and raises in backward. FP32 and raw FP16 (all
one dtype) train. The module whose autograd node raised is ``proj``.

    ampdoctor triage sample_models/custom_function.py   # verdict: amp_misuse, module proj, step 0
"""

import torch
from torch import nn


class ScaledMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight.t(), x.transpose(-2, -1) @ grad


class Proj(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        return ScaledMatmul.apply(x, self.weight)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.proj = Proj(32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(self.embed(x))))


def build_model() -> nn.Module:
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    return [(x, torch.tanh(x @ w)) for x in (torch.randn(32, 16, generator=g) for _ in range(4))]


def loss_fn(output, target):
    return (output.float() - target.float()).pow(2).mean()
