"""(b2) A CaiT-style vision transformer in pure FP16: patch embedding, two plain self-attention blocks (no scale),
then two blocks whose attention and MLP branches are each behind a learnable LayerScale of 1e-6 (CaiT's deep
setting), and a head on the mean token. The fault sits deep in the net (the later blocks only): their branch
gradients flush to zero in FP16 (gamma x ~1e-3 is below 2^-25), the early blocks, the gammas and the head train.
Backward reaches the last block's MLP first: ``blocks.3.mlp.2``.

    ampdoctor triage tests/unseen/layerscale_cait.py   # fp16_grad_underflow, module blocks.3.mlp.2, step 0
"""

import torch
from torch import nn
from torch.nn import functional as F

TRIAGE_OPTIONS = {"target": "fp16"}


class Block(nn.Module):
    def __init__(self, d: int, scale: float | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gamma_1 = nn.Parameter(torch.full((d,), scale)) if scale is not None else None
        self.gamma_2 = nn.Parameter(torch.full((d,), scale)) if scale is not None else None

    def forward(self, x):
        h = self.norm1(x)
        a = self.attn(h, h, h, need_weights=False)[0]
        x = x + (a if self.gamma_1 is None else self.gamma_1 * a)
        m = self.mlp(self.norm2(x))
        return x + (m if self.gamma_2 is None else self.gamma_2 * m)


class CaiT(nn.Module):
    def __init__(self, d: int = 32, classes: int = 3) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, d, 4, stride=4)
        self.pos = nn.Parameter(torch.zeros(1, 16, d))
        self.blocks = nn.Sequential(Block(d, None), Block(d, None), Block(d, 1e-6), Block(d, 1e-6))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(5)
    return CaiT()


def build_dataloader():
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(6):
        y = torch.randint(0, 3, (12,), generator=g)
        img = torch.randn(12, 1, 16, 16, generator=g) * 0.3
        img[:, :, :8] += y.view(-1, 1, 1, 1).float() - 1.0
        out.append((img, y))
    return out


def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)
