"""Gradients too small for FP16: the loss is normalised by the whole corpus size (1e15 tokens),
so every gradient is ~1e-17. Even GradScaler's 65536 leaves them below FP16's smallest
subnormal (6e-8): they flush to zero and AMP stops learning, while FP32 (Adam with a tiny eps)
trains.

    ampdoctor triage sample_models/grad_underflow.py   # verdict: fp16_grad_underflow, module head
"""

import torch
from torch import nn

CORPUS_TOKENS = 1e15


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(x))


def build_model() -> nn.Module:
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    out = []
    for _ in range(10):
        x = torch.randn(64, 16, generator=g)
        out.append((x, torch.tanh(x @ w)))
    return out


def loss_fn(output, target):
    return (output.float() - target).pow(2).sum() / CORPUS_TOKENS


def build_optimizer(params):
    return torch.optim.Adam(params, lr=1e-2, eps=1e-30)
