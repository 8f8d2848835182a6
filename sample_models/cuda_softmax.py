"""A softmax written out as exp / sum overflows FP16 under CPU autocast, not under CUDA's autocast policy.

The attention in `blocks.0.attn` computes its softmax by hand, ``e = scores.exp(); e / e.sum(-1)``, without
subtracting the row's maximum first. Its scaled scores reach about 14, and e^14 = 1.2e6 is beyond FP16's
65504. CUDA autocast runs ``exp`` and ``sum`` in FP32 (they are on PyTorch's CUDA fp32 list), so on a GPU the
softmax stays finite and AMP trains; CPU autocast leaves ``exp`` in the FP16 of the matmul that feeds it,
so on the CPU the AMP stage goes NaN at the first step.

    ampdoctor triage sample_models/cuda_softmax.py                          # CPU autocast: fp16_forward_overflow
    ampdoctor triage sample_models/cuda_softmax.py --autocast-policy cuda   # CUDA's policy: healthy, and says why
"""

import math

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        e = scores.exp()  # bug: no max subtracted first (torch.softmax does it); exp(14) > 65504
        return self.out(e / e.sum(dim=-1, keepdim=True) @ v)


class Model(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.attn = Attention(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.attn(h)
        return self.head(h).mean(dim=1)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 12, 8, generator=g) * 6, torch.randn(4, 1, generator=g)) for _ in range(8)]


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
