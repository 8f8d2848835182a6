"""(a3) A token model (embedding, self-attention, LayerNorm) with per-token Laplace regression: a ``spread`` head and
a ``loc`` head joined by the root's ``cat``, spread first. The Laplace NLL |t - loc| / b + log b with b = |spread| +
3e-4 has the gradient -|t - loc| / b^2 / N w.r.t. the spread slice: ~1e7 / N x |t - loc|, beyond FP16's 65504
unscaled at the tokens where b is smallest, while the loc slice's, sign / b / N, is ~35. Only ``spread``'s slice
carries the inf unscaled; at GradScaler's 2^16 both do.

    ampdoctor triage tests/unseen/join_token_laplace.py   # fp16_grad_overflow, module spread, step 0
"""

import torch
from torch import nn


class TokenLaplace(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.spread = nn.Linear(d, 1)
        self.loc = nn.Linear(d, 1)
        with torch.no_grad():
            self.spread.weight.mul_(1e-4)
            self.spread.bias.zero_()

    def forward(self, ids):
        x = self.embed(ids)
        a, _ = self.attn(x, x, x, need_weights=False)
        h = self.norm(x + a)
        return torch.cat([self.spread(h), self.loc(h)], dim=-1)


def build_model() -> nn.Module:
    torch.manual_seed(3)
    return TokenLaplace()


def build_dataloader():
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(4):
        ids = torch.randint(0, 50, (8, 12), generator=g)
        out.append((ids, ids.float().unsqueeze(-1) / 10.0 + torch.randn(8, 12, 1, generator=g)))
    return out


def loss_fn(output, target):
    out = output.float()
    b = out[..., :1].abs() + 3e-4
    return (torch.abs(target - out[..., 1:]) / b + torch.log(b)).mean()
