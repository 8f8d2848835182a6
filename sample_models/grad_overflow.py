"""Gradients too large for FP16: the loss is a sum weighted by 1e7, so the gradient that enters
the model at its output exceeds 65504 even unscaled. GradScaler halves its scale every step
and collapses below 1. The forward pass is fine.

    ampdoctor triage sample_models/grad_overflow.py   # verdict: fp16_grad_overflow, module head, step 0
"""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh())
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.body(x))


def build_model() -> nn.Module:
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)) for _ in range(8)]


def loss_fn(output, target):
    # a summed loss with a large weight: fine in FP32 (Adam is scale-invariant), fatal in FP16
    return 1e7 * (output.float() - target).pow(2).sum()
