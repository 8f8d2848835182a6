"""A left-padded causal decoder that hides its NaN: the causal mask and the padding mask together leave the padded
first positions of sample 1 with no key. The mask is added to the scores (a bias of -inf), ``softmax`` makes
NaN on those rows, and ``torch.nan_to_num`` on the probabilities makes the forward finite. The backward is not:
softmax's gradient is ``p * (g - sum(g * p))``, NaN on those rows whatever ``g`` is (0 included), the addition passes
it on to the scores, and it reaches every weight of the attention, for the whole batch. model_bug in backward at ``blocks.0.attn``, the autograd node ``SoftmaxBackward0`` and its line."""

import torch
from torch import nn
from torch.nn import functional as F


class CausalAttn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = x.shape[1]
        hidden = ~torch.ones(t, t, dtype=torch.bool).tril()[None] | ~keep[:, None, :]
        s = (q @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
        bias = torch.zeros(hidden.shape, dtype=s.dtype).masked_fill(hidden, float("-inf"))
        p = torch.nan_to_num(F.softmax(s + bias, dim=-1))
        return self.out(p @ v)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = CausalAttn(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, keep):
        x = x + self.attn(self.ln(x), keep)
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(40, 24)
        self.blocks = nn.ModuleList([Block(24), Block(24)])
        self.lm = nn.Linear(24, 40)

    def forward(self, ids, keep):
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x, keep)
        return self.lm(x)


def build_model() -> nn.Module:
    torch.manual_seed(4)
    return Decoder()


def build_dataloader():
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(4):
        ids = torch.randint(1, 40, (4, 10), generator=g)
        keep = torch.ones(4, 10, dtype=torch.bool)
        keep[1, :4] = False  # sample 1 is left-padded by 4
        ids[1, :4] = 0
        labels = torch.randint(1, 40, (4, 10), generator=g)
        labels[~keep] = -100  # no loss on padding: the forward loss stays finite
        out.append((ids, keep, labels))
    return out


def loss_fn(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten(), ignore_index=-100)
