"""A small MLP regression whose FP8 GEMMs train like BF16: nothing flushes, nothing saturates.

    ampdoctor triage sample_models/fp8_healthy.py --target fp8        # verdict: healthy
"""

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    batches = []
    for _ in range(10):
        x = torch.randn(32, 16, generator=g)
        batches.append((x, x @ w + 0.5 * torch.randn(32, 1, generator=g)))
    return batches


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
