"""(b3) A 1-D MLP-Mixer on sequences in pure FP16 where only the first block has a learnable LayerScale, at 1e-7,
on both its token-mixing and channel-mixing branches; the two later blocks are plain residual MLPs. The fault sits at
the bottom of the net: backward reaches the later blocks first (their gradients are not flushed), then the first
block's channel branch, ``blocks.0.channel.2``, whose gradient (1e-7 x the stream's) flushes to zero in FP16.
The regression target and Adam with eps=1e-4 (the FP16-safe epsilon: 1e-8 rounds to 0 in FP16) differ from the other
two.

    ampdoctor triage tests/unseen/layerscale_mixer_first.py   # fp16_grad_underflow, module blocks.0.channel.2, step 0
"""

import torch
from torch import nn

TRIAGE_OPTIONS = {"target": "fp16"}


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, d: int, scale: float | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.token = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.norm2 = nn.LayerNorm(d)
        self.channel = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ls1 = nn.Parameter(torch.full((d,), scale)) if scale is not None else None
        self.ls2 = nn.Parameter(torch.full((d,), scale)) if scale is not None else None

    def forward(self, x):
        t = self.token(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        x = x + (t if self.ls1 is None else self.ls1 * t)
        c = self.channel(self.norm2(x))
        return x + (c if self.ls2 is None else self.ls2 * c)


class Mixer(nn.Module):
    def __init__(self, tokens: int = 10, d: int = 24) -> None:
        super().__init__()
        self.embed = nn.Linear(6, d)
        self.blocks = nn.Sequential(MixerBlock(tokens, d, 1e-7), MixerBlock(tokens, d, None), MixerBlock(tokens, d, None))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        return self.out(self.blocks(self.embed(x))).squeeze(-1)


def build_model() -> nn.Module:
    torch.manual_seed(6)
    return Mixer()


def build_dataloader():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(6, generator=g)
    out = []
    for _ in range(8):
        x = torch.randn(48, 10, 6, generator=g)
        out.append((x, torch.tanh(x @ w).cumsum(dim=1) / 3.0))
    return out


def loss_fn(output, target):
    return (output.float() - target).pow(2).mean()


def build_optimizer(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-4)
