"""(a) A gradient entering through the root's join of several heads: the root mixes three heads that share a
trunk as ``left + 1000 * mid + right``; at GradScaler's 2^16 the gradient entering ``mid`` overflows FP16. ``left`` and
``right`` read the same trunk output, whose accumulated gradient is non-finite only because of ``mid``. Verdict:
fp16_grad_overflow, module mid."""

import torch
from torch import nn


class Heads(nn.Module):
    """A shared trunk and three heads joined by the root's own weighted sum: the root scales the second head's
    output by 1000 (a fixed mixing weight), so in backward the gradient entering `mid` is 1000x the model output's."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(12, 24), nn.GELU())
        self.left = nn.Linear(24, 2)
        self.mid = nn.Linear(24, 2)
        self.right = nn.Linear(24, 2)

    def forward(self, x):
        z = self.trunk(x)
        return self.left(z) + self.mid(z) * 1000.0 + self.right(z)


def build_model():
    torch.manual_seed(0)
    m = Heads()
    with torch.no_grad():
        m.mid.weight.mul_(1e-3)
        m.mid.bias.zero_()
    return m


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 12, generator=g), torch.randn(32, 2, generator=g)) for _ in range(4)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-8)
