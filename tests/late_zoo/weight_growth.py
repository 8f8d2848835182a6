"""Weight growth: an MLP regressing a target near 7e4 (a quantity in its raw units). Adam grows the weights
towards it by about its learning rate a step, and the output with them, until the last layer's FP16 output passes
65504 before the target is reached: a forward overflow at a late step, FP32 untroubled."""

import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def batch(step: int, g: torch.Generator):
    x = torch.rand(32, 8, generator=g)
    return x, 7e4 + 1e3 * x[:, :1]


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [batch(s, g) for s in range(8)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float() * 1e-4, y * 1e-4)


def build_optimizer(params):
    return torch.optim.Adam(params, lr=0.2)
