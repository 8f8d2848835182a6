"""A BERT-style extended attention mask, ``(1.0 - mask) * -1e9`` added to the scores, built in the scores' dtype.
Sample 0 of every batch is all padding. In FP32 its rows are -1e9 throughout and softmax spreads them evenly: finite.
Under FP16 autocast the scores are FP16, -1e9 is beyond FP16's range and becomes -inf, and a row of -inf is 0/0 = NaN.
fp16_forward_overflow at ``encoder.attn``, its ``mul`` reaching 1e9; the fix is the constant
(``torch.finfo(dtype).min``)."""

import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-2, -1) / x.shape[-1] ** 0.5
        s = s + (1.0 - mask[:, None, :].to(s.dtype)) * -1e9
        return s.softmax(dim=-1) @ self.v(x)


class Encoder(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = SelfAttention(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        x = x + self.attn(x, mask)
        return x + self.ff(x)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.encoder = Encoder(32)
        self.tags = nn.Linear(32, 5)

    def forward(self, ids, mask):
        return self.tags(self.encoder(self.embed(ids), mask))


def build_model() -> nn.Module:
    torch.manual_seed(5)
    return Tagger()


def build_dataloader():
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(4):
        ids = torch.randint(1, 50, (6, 12), generator=g)
        mask = torch.ones(6, 12)
        mask[:, 9:] = 0.0
        mask[0] = 0.0  # sample 0 is all padding
        out.append((ids, mask, torch.randint(0, 5, (6, 12), generator=g)))
    return out


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())
