"""An attention whose padding mask covers every key of one sample (a fully padded sequence): softmax over a row that
is all -inf is 0/0 = NaN, in every precision. model_bug at ``attn``; the fix is about the mask."""

import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        s = s.masked_fill(pad[:, None, :], float("-inf"))
        return torch.softmax(s, dim=-1) @ v


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.attn = Attn(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x, pad):
        return self.head(self.attn(self.embed(x), pad).mean(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        x = torch.randn(6, 5, 4, generator=g)
        pad = torch.zeros(6, 5, dtype=torch.bool)
        pad[:, 4] = True
        pad[3] = True  # sample 3 is all padding
        out.append((x, pad, torch.randn(6, 1, generator=g)))
    return out


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)
