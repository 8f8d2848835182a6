"""A warm-up ending: an MLP whose learning rate ramps up over 100 steps to a peak 1000 times too high. Once the
warm-up ends the loss grows about threefold a step, and the gradient into the last layer, times GradScaler's
65536, passes FP16's 65504 at step 109. Both hidden layers end in Tanh: bounded features keep the last layer's
gradient growing; a ReLU there could die under this learning rate before anything overflowed, and whether it did
depended on the CPU's FP16 matmul (native AVX512-FP16 arithmetic or not)."""

import torch
from torch import nn

WARMUP = 100


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def lr_at(step: int) -> float:
    return 1e-3 * min(1.0, step / WARMUP) + (1.0 if step >= WARMUP else 0.0)


def batch(step: int, g: torch.Generator):
    x = torch.randn(32, 16, generator=g)
    return x, torch.randn(32, 4, generator=g)


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [batch(s, g) for s in range(4)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
