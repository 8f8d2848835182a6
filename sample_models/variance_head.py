"""Gradients that overflow where they enter the model, made by the root's own forward.

The model predicts a mean and a variance: ``var = softplus(var_head(h))`` and the root returns
``cat([mu, var])``. The variance starts near 1e-3 (bias -7), so the Gaussian NLL's gradient with
respect to it, -(t - mu)^2 / var^2, is ~1e6: beyond FP16's 65504 even unscaled. The gradient is
already inf at the model's output (the cat, in the root's code); the first module it enters is
``var_head``, behind the softplus.

    ampdoctor triage sample_models/variance_head.py   # verdict: fp16_grad_overflow, module var_head
"""

import torch
from torch import nn
from torch.nn import functional as F


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.mean_head = nn.Linear(32, 1)
        self.var_head = nn.Linear(32, 1)
        with torch.no_grad():
            self.var_head.weight.mul_(0.01)
            self.var_head.bias.fill_(-7.0)

    def forward(self, x):
        h = self.body(x)
        return torch.cat([self.mean_head(h), F.softplus(self.var_head(h))], dim=-1)


def build_model() -> nn.Module:
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)) for _ in range(6)]


def loss_fn(output, target):
    out = output.float()
    mu, var = out[:, :1], out[:, 1:]
    return (0.5 * ((target - mu) ** 2 / var + torch.log(var))).mean()
