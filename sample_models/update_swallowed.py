"""Pure FP16 training (model.half() with the optimizer on FP16 weights): Adam's eps=1e-8 rounds
to 0 in FP16, so the first update divides by zero and the weights become inf/NaN, while FP32
trains. TRIAGE_OPTIONS makes --target fp16 the default for this file.

    ampdoctor triage sample_models/update_swallowed.py   # verdict: fp16_update_swallowed, step 0
"""

import torch
from torch import nn

TRIAGE_OPTIONS = {"target": "fp16"}


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    out = []
    for _ in range(10):
        x = torch.randn(32, 16, generator=g)
        out.append((x, x @ w))
    return out


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)


def build_optimizer(params):
    return torch.optim.Adam(params, lr=1e-3)
