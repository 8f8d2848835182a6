"""(b) Gradient underflow spread over several layers: four blocks defined in one order and run in the other,
behind an output layer; a loss of ~1e-6 (init_scale 1, so no loss scaling helps) flushes most gradients of every
layer. Backward reaches ``out`` first (>half flushed, still moving), then ``blocks.0``. Verdict: fp16_grad_underflow,
module out."""

import torch
from torch import nn


class Tower(nn.Module):
    """Four blocks defined in one order and run in the other, each a Linear + Tanh; a loss ~1e-4 makes every
    block's weight gradient ~1e-8 to 1e-7: below FP16's smallest subnormal in several layers at once."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        for b in reversed(self.blocks):
            x = b(x)
        return self.out(x)


def build_model():
    torch.manual_seed(0)
    return Tower()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)) for _ in range(4)]


def loss_fn(out, y):
    return 1e-6 * nn.functional.mse_loss(out.float(), y)


def build_optimizer(params):
    return torch.optim.Adam(params, lr=1e-3)
