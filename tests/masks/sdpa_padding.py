"""``scaled_dot_product_attention`` with a boolean padding mask, sample 3 all padding. PyTorch's SDPA returns 0 for a
query that may attend to no key (forward and backward finite: measured on torch 2.13's CPU kernels, math and flash,
FP32, FP16 and BF16), so this trains: healthy. The twin of ``mha_padding.py`` (same mask, softmax path: NaN)."""

import torch
from torch import nn
from torch.nn import functional as F


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, keep):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.out(o.transpose(1, 2).reshape(b, t, d))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.attn = Attn(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x, keep):
        h = self.embed(x)
        return self.head((h + self.attn(h, keep)).mean(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(6)
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(6)
    out = []
    for _ in range(4):
        x = torch.randn(5, 7, 6, generator=g)
        keep = torch.ones(5, 7, dtype=torch.bool)
        keep[:, 5:] = False
        keep[3] = False  # sample 3 is all padding
        out.append((x, keep, torch.randn(5, 3, generator=g)))
    return out


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)
