"""An auxiliary loss weighted 1e-11 beside the main one: its output gradients are below E5M2's smallest
subnormal once the main loss's gradients set the scale.

The tensorwise recipe casts output gradients to E5M2 with the scale 57344 / amax. E5M2 holds magnitudes
from 57344 down to 2^-16, a span of about 3.8e9: a gradient more than ~7.5e9 times smaller than the
largest in the same tensor is cast to 0. Both losses reach the head through one Linear, so the auxiliary
column's gradients (1e-11 of the main's) flush in FP8; BF16 keeps them and Adam, which divides by the
gradient's own size, trains the auxiliary output as fast as the main one. In FP8 that column never learns.

    ampdoctor triage sample_models/fp8_grad_underflow.py --target fp8  # verdict: fp8_grad_underflow, head
"""

import torch
from torch import nn

AUX_WEIGHT = 1e-11


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.head = nn.Linear(32, 2)  # column 0: the main target, column 1: the auxiliary one

    def forward(self, x):
        return self.head(self.body(x))


def build_model() -> nn.Module:
    return TwoHeads()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 2, generator=g)
    return [(x, x @ w) for x in (torch.randn(32, 16, generator=g) for _ in range(8))]


def loss_fn(output, target):
    main = nn.functional.mse_loss(output[:, 0], target[:, 0])
    aux = nn.functional.mse_loss(output[:, 1], target[:, 1])
    return main + AUX_WEIGHT * aux
