"""(e) Tabular features where 1e5 marks a missing value, masked by the model in FP32 before any autocast op: the
AMP run is unaffected (healthy), but the data holds a value FP16 cannot represent, which the verdict says."""

import torch
from torch import nn

MISSING = 1e5


class Tabular(nn.Module):
    """Reads features where 1e5 marks a missing value and replaces it (in FP32, before any autocast op) by 0."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.SiLU(), nn.Linear(16, 1))

    def forward(self, x):
        x = torch.where(x == MISSING, torch.zeros_like(x), x)
        return self.net(x)


def build_model():
    torch.manual_seed(0)
    return Tabular()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        x = torch.randn(32, 6, generator=g)
        if i == 3:
            x[7, 2] = MISSING  # one missing value, in one batch
        out.append((x, torch.randn(32, 1, generator=g)))
    return out


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-2)
