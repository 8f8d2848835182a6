"""A spec where tensor size dominates, for the memory bench: 3 x Linear(1024, 1024), batch 128."""

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024))


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(128, 1024, generator=g), torch.randn(128, 1024, generator=g)) for _ in range(4)]


def loss_fn(output, target):
    return nn.functional.mse_loss(output.float(), target)
