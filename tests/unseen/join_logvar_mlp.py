"""(a1) A heteroscedastic regressor on tabular features: a mean head and a log-variance head joined by the root's
``cat``. The Gaussian NLL weighs the squared error by exp(-log_var); log_var starts near -14, so the gradient with
respect to the log-variance slice, 0.5 (t - mu)^2 exp(-log_var) / N, is ~1e5: beyond FP16's 65504 unscaled. The
mean's slice, (mu - t) exp(-log_var) / N, fits FP16 unscaled but overflows too at GradScaler's 2^16 (both slices are
non-finite at step 0). The head listed first in the join is ``mu``; the inf is ``log_var``'s.

    ampdoctor triage tests/unseen/join_logvar_mlp.py   # fp16_grad_overflow, module log_var, step 0
"""

import torch
from torch import nn


class Hetero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU())
        self.mu = nn.Linear(64, 1)
        self.log_var = nn.Linear(64, 1)
        with torch.no_grad():
            self.log_var.weight.mul_(0.01)
            self.log_var.bias.fill_(-14.0)

    def forward(self, x):
        h = self.trunk(x)
        return torch.cat([self.mu(h), self.log_var(h)], dim=-1)


def build_model() -> nn.Module:
    torch.manual_seed(1)
    return Hetero()


def build_dataloader():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(10, 1, generator=g)
    out = []
    for _ in range(6):
        x = torch.randn(256, 10, generator=g)
        out.append((x, x @ w + 3.0 * torch.randn(256, 1, generator=g)))
    return out


def loss_fn(output, target):
    out = output.float()
    mu, log_var = out[:, :1], out[:, 1:]
    return (0.5 * (log_var + (target - mu) ** 2 * torch.exp(-log_var))).mean()
