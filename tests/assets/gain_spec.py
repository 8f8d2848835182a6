"""A layer whose output is 2e5 x its input: overflows FP16, not BF16 (used by the layers tests)."""
import torch
from torch import nn


class Gain(nn.Module):
    def forward(self, x):
        return x * 2e5

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.big = Gain()
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.big(self.inp(x)) * 1e-5)

def build_model():
    return Net()

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(2)]

def loss_fn(o, t):
    return nn.functional.mse_loss(o, t)
