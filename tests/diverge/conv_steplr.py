"""A small conv net trained with SGD (momentum 0.9) under a step schedule written backwards: every 15 steps the
learning rate is multiplied by 10 (gamma=10 where 0.1 was meant), from 1e-3. At step 60 it reaches 10: the updates
throw the weights about, the loss climbs by orders of magnitude and the gradient norm with it, in FP32 as under
autocast, every value finite for a while."""

import torch
from torch import nn

EVERY, GAMMA = 15, 10.0


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 8, 3, padding=1), nn.GELU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 5))


def lr_at(step: int) -> float:
    return 1e-3 * GAMMA ** (step // EVERY)


def batch(step: int, g: torch.Generator):
    return torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 5, (16,), generator=g)


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [batch(s, g) for s in range(8)]


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float(), y)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
