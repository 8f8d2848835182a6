"""Residual branches frozen by underflow in pure FP16 while the loss still falls.

Each block adds ``gamma * mlp(x)`` to the residual stream, with a fixed LayerScale-style gain
gamma = 1e-6 (a buffer, as in a scaled-residual init). The gradient reaching the branch is gamma times the stream's (~1e-3 here), about
1e-9: below FP16's smallest subnormal (2^-24 ≈ 6e-8), so it flushes to zero and the branch
weights never move, while the stem and head train and the loss keeps pace with FP32.

    ampdoctor triage sample_models/frozen_branch.py   # verdict: fp16_grad_underflow, module blocks.1.fc2
"""

import torch
from torch import nn

TRIAGE_OPTIONS = {"target": "fp16"}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * d, d)
        self.register_buffer("gamma", torch.full((d,), 1e-6))  # a fixed residual gain

    def forward(self, x):
        return x + self.gamma * self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.blocks = nn.Sequential(Block(32), Block(32))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def build_model() -> nn.Module:
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g) / 4
    out = []
    for _ in range(8):
        x = torch.randn(64, 16, generator=g)
        out.append((x, x @ w))
    return out


def loss_fn(output, target):
    return (output.float() - target.float()).pow(2).mean()


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
