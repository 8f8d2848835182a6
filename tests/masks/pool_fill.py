"""Attention pooling for a text classifier: one learned query scores every token, ``masked_fill(~keep, -1e9)`` hides
the padding, softmax over the tokens. No row is fully masked. Under FP16 autocast the scores are FP16 and -1e9 is
beyond FP16's range: PyTorch refuses to fill it ("value cannot be converted to type c10::Half without overflow").
fp16_forward_overflow at ``pool`` (its ``masked_fill`` writing 1e9), the fix is the constant; FP32 trains."""

import torch
from torch import nn


class AttentionPool(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(d) / d ** 0.5)
        self.key = nn.Linear(d, d)

    def forward(self, h, keep):
        scores = self.key(h) @ self.query
        weights = scores.masked_fill(~keep, -1e9).softmax(dim=-1)
        return (weights[..., None] * h).sum(dim=1)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(60, 20)
        self.mix = nn.Sequential(nn.Linear(20, 20), nn.Tanh())
        self.pool = AttentionPool(20)
        self.out = nn.Linear(20, 4)

    def forward(self, ids, keep):
        return self.out(self.pool(self.mix(self.embed(ids)), keep))


def build_model() -> nn.Module:
    torch.manual_seed(8)
    return Classifier()


def build_dataloader():
    g = torch.Generator().manual_seed(8)
    out = []
    for _ in range(4):
        ids = torch.randint(1, 60, (8, 11), generator=g)
        lengths = torch.randint(3, 12, (8,), generator=g)
        keep = torch.arange(11)[None, :] < lengths[:, None]
        out.append((ids.masked_fill(~keep, 0), keep, torch.randint(0, 4, (8,), generator=g)))
    return out


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float(), y)
