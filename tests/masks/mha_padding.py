"""A set encoder on padded sequences through ``nn.MultiheadAttention`` with a ``key_padding_mask``: sample 2 of every
batch is all padding, so each of its queries may attend to no key. With ``need_weights=True`` (the default),
``multi_head_attention_forward`` takes a softmax over rows of -inf: 0/0 = NaN in every precision. model_bug at
``attn``, the rows of sample 2 named; the fix is the mask."""

import torch
from torch import nn


class SetEncoder(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(6, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x, pad):
        h = self.embed(x)
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        return self.head((h + a).mean(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(3)
    return SetEncoder()


def build_dataloader():
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(4):
        x = torch.randn(5, 7, 6, generator=g)
        pad = torch.zeros(5, 7, dtype=torch.bool)
        pad[:, 5:] = True
        pad[2] = True  # sample 2 is all padding
        out.append((x, pad, torch.randn(5, 3, generator=g)))
    return out


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)
