"""NaN only under torch.compile: a frozen backbone's gated MLP guards its FP16 product with ``torch.nan_to_num``.

Eager PyTorch rounds ``up(x) * gate(x)`` to FP16 (inf past 65504), and ``nan_to_num`` turns the inf into 65504: the
guard works. Inductor fuses the product and the guard into one kernel that computes in FP32: the guard sees a finite
~1e5 and passes it, and the store to FP16 after it rounds it to inf; ``down`` (a matmul) makes NaN of it.

    ampdoctor triage sample_models/compile_nan.py --compile   # verdict: compile_numerics, inductor's code, nan_to_num
"""

import torch
from torch import nn

TRIAGE_OPTIONS = {"steps": 8}


class GatedMLP(nn.Module):
    def __init__(self, d: int = 16, h: int = 32):
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)
        with torch.no_grad():  # a pretrained block with massive activations (thousands) and a small output projection
            self.up.weight.mul_(400)
            self.gate.weight.mul_(400)
            self.down.weight.mul_(1e-4)

    def forward(self, x):
        h = self.up(x) * self.gate(x)  # FP16: a few of the products pass 65504
        h = torch.nan_to_num(h)  # the FP16 guard: inf -> 65504
        return self.down(h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.mlp = GatedMLP()
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.mlp(self.embed(x)))


def build_model() -> nn.Module:
    net = Net()
    net.embed.requires_grad_(False)  # a frozen backbone: only the head is trained
    net.mlp.requires_grad_(False)
    return net


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(8):
        x = torch.randn(16, 8, generator=g)
        out.append((x, torch.randn(16, 16, generator=g)))
    return out


def loss_fn(output, target):
    return nn.functional.mse_loss(output.float(), target)
