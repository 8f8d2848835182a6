"""(c) Branches frozen by underflow behind a learnable LayerScale gain (1e-6) in pure FP16, trained with weight
decay while the loss falls: decay moves the frozen branch weights as far as in FP32, so movement cannot tell them;
their gradient flushes at every step. Verdict: fp16_grad_underflow (frozen), module mixers.2.mlp.2."""

import torch
from torch import nn


class LayerScale(nn.Module):
    def __init__(self, d: int, init: float = 1e-6) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), init))

    def forward(self, x):
        return x * self.gamma


class Mixer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.ls = LayerScale(d)

    def forward(self, x):
        return x + self.ls(self.mlp(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(10, 24)
        self.mixers = nn.ModuleList([Mixer(24) for _ in range(3)])
        self.proj = nn.Linear(24, 3)

    def forward(self, x):
        x = self.embed(x)
        for m in self.mixers:
            x = m(x)
        return self.proj(x)


def build_model():
    torch.manual_seed(0)
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 3, generator=g) / 3
    return [(x, x @ w) for x in (torch.randn(48, 10, generator=g) for _ in range(8))]


def loss_fn(out, y):
    return 0.001 * (out.float() - y).pow(2).mean()


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.05)
