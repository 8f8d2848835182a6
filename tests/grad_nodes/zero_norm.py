"""Pairwise distances between learned coordinates, ``sqrt`` of the summed squared differences: each point's distance
to itself is 0, finite in the forward, and sqrt's gradient there is 1 / (2 * 0) = Inf (then 0 * Inf = NaN in the
squared difference's backward). A model bug in every precision, made in backward: model_bug at ``geometry``, the
autograd node ``SqrtBackward0`` and its line; the fix guards the op (``clamp_min`` before ``sqrt``)."""

import torch
from torch import nn


class Geometry(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.place = nn.Linear(5, 3)

    def forward(self, x):
        c = self.place(x)
        return ((c[:, :, None] - c[:, None, :]) ** 2).sum(-1).sqrt()


class PairEnergy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.geometry = Geometry()
        self.radial = nn.Sequential(nn.Linear(1, 8), nn.SiLU(), nn.Linear(8, 1))

    def forward(self, x):
        d = self.geometry(x)
        return self.radial(d[..., None]).sum(dim=(1, 2, 3))


def build_model() -> nn.Module:
    torch.manual_seed(7)
    return PairEnergy()


def build_dataloader():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 6, 5, generator=g), torch.randn(4, generator=g)) for _ in range(4)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)
