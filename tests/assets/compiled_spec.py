"""healthy.py's regression, but build_model() returns a torch.compile'd model (the eager backend:
no C compiler needed, and the same dynamo tracing that met our hooks)."""

import torch
from torch import nn


def build_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    return torch.compile(model, backend="eager")


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    batches = []
    for _ in range(10):
        x = torch.randn(32, 16, generator=g)
        batches.append((x, x @ w + 0.1 * torch.randn(32, 1, generator=g)))
    return batches


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
