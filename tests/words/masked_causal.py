"""A left-padded causal decoder: the causal mask and the padding mask combined leave the first (padded) query
position of a left-padded sample with no key at all; ``torch.where(keep, s, -inf)`` then ``softmax`` makes NaN there,
in every precision. model_bug at ``blocks.0.attn``; the fix is about the mask."""

import torch
from torch import nn
from torch.nn import functional as F


class CausalAttn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, keep):
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        allowed = causal[None] & keep[:, None, :]
        s = self.q(x) @ self.k(x).transpose(1, 2) / 4.0
        p = F.softmax(torch.where(allowed, s, torch.full_like(s, float("-inf"))), dim=-1)
        return p @ self.v(x)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = CausalAttn(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, keep):
        x = x + self.attn(x, keep)
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(30, 16)
        self.blocks = nn.ModuleList([Block(16), Block(16)])
        self.lm = nn.Linear(16, 30)

    def forward(self, ids, keep):
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x, keep)
        return self.lm(x)


def build_model() -> nn.Module:
    torch.manual_seed(2)
    return Decoder()


def build_dataloader():
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(4):
        ids = torch.randint(1, 30, (4, 9), generator=g)
        keep = torch.ones(4, 9, dtype=torch.bool)
        keep[1, :3] = False  # sample 1 is left-padded by 3
        ids[1, :3] = 0
        out.append((ids, keep, torch.randint(0, 30, (4, 9), generator=g)))
    return out


def loss_fn(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())
