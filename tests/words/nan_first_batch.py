"""A regression MLP whose first batch holds a NaN (sample 5), replayed by a dataloader of 8 batches cycled to make
the steps: GradScaler skips at steps 0, 8, 16 ... on the same batch. The skip at step 0 follows a non-finite loss, so
it is no calibration step, and the repeated batch is one batch, said once."""

import torch
from torch import nn


def build_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))


def build_dataloader():
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(8):
        x = torch.randn(16, 10, generator=g)
        if i == 0:
            x[5, 2] = float("nan")
        out.append((x, x[:, :1] * 0.5))
    return out


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)
