"""A bad record deep in a shuffled loader: 3000 tabular records, one of them (record 2311) holding a NaN, in
batches of 25 reshuffled every epoch by a seeded generator. The run trains cleanly until the batch holding that
record comes, in the loader's order, at step 115 of the 120 in the first epoch."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BAD = 2311


def records() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 10, generator=g)
    y = x[:, :3].sum(-1, keepdim=True)
    x[BAD, 4] = float("nan")
    return TensorDataset(x, y)


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))


def build_dataloader():
    return DataLoader(records(), batch_size=25, shuffle=True, generator=torch.Generator().manual_seed(4))


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)
