"""A conv net unlike sample_models/compile_nan.py: a frozen conv stem's local energy ``y * y`` in FP16, guarded with
``torch.where(torch.isinf(e), finfo.max, e)``, then a 1x1 conv and pooling into a trained linear head; pure FP16
training (``model.half()``, SGD), the target fp16.

Eager: ``y * y`` rounds to inf past 65504 and the guard replaces it with 65504. Inductor fuses the square and the
guard into one kernel computing in FP32 (``isinf`` of a finite ~1e5 is false), and the store to FP16 for the conv
makes it inf; the 1x1 conv mixes it into NaN/inf.
"""

import torch
from torch import nn

TRIAGE_OPTIONS = {"steps": 3, "target": "fp16"}


class Energy(nn.Module):
    def forward(self, y):
        e = y * y  # FP16: past 65504 where |y| > 256
        return torch.where(torch.isinf(e), torch.full_like(e, torch.finfo(e.dtype).max), e)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.energy = Energy()
        self.mix = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.stem.weight.mul_(300)  # a stem with large responses (un-normalised pixels)
            self.mix.weight.mul_(1e-4)

    def forward(self, x):
        h = self.mix(self.energy(self.stem(x)))
        return self.head(h.mean(dim=(2, 3)))


def build_model() -> nn.Module:
    net = Net()
    net.stem.requires_grad_(False)
    net.mix.requires_grad_(False)
    return net


def build_dataloader():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-2)


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.float(), target)
