"""Unscaled attention logits overflow FP16: q @ k^T reaches ~1e5 inside `blocks.1.attn`.

The overflow happens in a functional op inside the attention module, so the report names
`blocks.1.attn`, not the projection that only passes the inf on.

The encoder (embed and both blocks) is taken as pretrained and frozen; only the head is trained
(a linear probe). That keeps the 50-step run well-conditioned: the second block's softmax is
saturated (its logits lie ~1e4 apart), and training through it makes the run chaotic, so that
the last step's loss, the skips and GradScaler's story would differ from one CPU's kernels to
another's. With the encoder frozen, every batch overflows (or not) the same way at every step,
and every CPU prints the same report. In AMP, batches 0 and 5 overflow at every visit.

    ampdoctor triage sample_models/forward_overflow.py   # verdict: fp16_forward_overflow, blocks.1.attn, step 0
"""

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
        scores = q @ k.transpose(-2, -1)  # bug: no 1/sqrt(d); with large activations this overflows FP16
        return self.out(torch.softmax(scores, dim=-1) @ v)


class Block(nn.Module):
    def __init__(self, d: int, gain: float):
        super().__init__()
        self.attn = Attention(d)
        self.gain = gain

    def forward(self, x):
        return x + self.attn(x * self.gain)


class Model(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList([Block(d, 1.0), Block(d, 40.0)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).mean(dim=1)


def build_model() -> nn.Module:
    model = Model()
    for name, p in model.named_parameters():  # a frozen encoder, a trained head
        p.requires_grad_(name.startswith("head."))
    return model


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 16, 8, generator=g) * 3, torch.randn(4, 1, generator=g)) for _ in range(8)]


def loss_fn(output, target):
    return nn.functional.mse_loss(output.float(), target)
