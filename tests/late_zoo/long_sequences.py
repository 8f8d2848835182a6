"""A curriculum: a 1-D conv net over sequences, sum-pooled over time. From step 150 the curriculum feeds sequences
4096 times longer; the ReLU features are positive, so their sum grows with the length and passes FP16's 65504 in the
pooling module: a forward overflow on the first long batch."""

import torch
from torch import nn


class SumPool(nn.Module):
    def forward(self, x):
        return x.sum(-1)


class SeqNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 5, padding=2)
        self.act = nn.ReLU()
        self.pool = SumPool()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.pool(self.act(self.conv(x))) / 64.0)


def build_model():
    torch.manual_seed(0)
    return SeqNet()


LONG_FROM = 150


def batch(step: int, g: torch.Generator):
    t = 64 if step < LONG_FROM else 64 * 4096
    x = torch.randn(2, 1, t, generator=g)
    return x, x.mean(-1)


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [batch(s, g) for s in range(4)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-3)
