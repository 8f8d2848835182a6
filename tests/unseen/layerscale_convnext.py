"""(b1) A ConvNeXt-style net in pure FP16: each block is a 7x7 depthwise conv, a LayerNorm over channels, a 4x MLP
and a learnable LayerScale gamma initialised to 1e-6 (ConvNeXt's default), added to the residual stream. In FP16
the gradient at the branch output, gamma times the stream's, is ~1e-9: below half FP16's smallest subnormal (2^-25),
so it flushes to zero and every weight inside the branches gets a zero gradient, while the stem, the gammas (whose
gradient is the branch output times the stream's gradient) and the head train and the loss falls. The first module
backward reaches inside a branch is the last block's ``pw2``.

    ampdoctor triage tests/unseen/layerscale_convnext.py   # fp16_grad_underflow, module stages.2.pw2, step 0
"""

import torch
from torch import nn
from torch.nn import functional as F

TRIAGE_OPTIONS = {"target": "fp16"}


class Block(nn.Module):
    def __init__(self, d: int, init: float = 1e-6) -> None:
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.pw1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.pw2 = nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(torch.full((d,), init))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.pw2(self.act(self.pw1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXtTiny(nn.Module):
    def __init__(self, d: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, stride=4)
        self.stages = nn.Sequential(Block(d), Block(d), Block(d))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


def build_model() -> nn.Module:
    torch.manual_seed(4)
    return ConvNeXtTiny()


def build_dataloader():
    g = torch.Generator().manual_seed(4)
    protos = torch.randn(5, 3, 16, 16, generator=g)
    out = []
    for _ in range(8):
        y = torch.randint(0, 5, (16,), generator=g)
        out.append((protos[y] + 0.5 * torch.randn(16, 3, 16, 16, generator=g), y))
    return out


def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
