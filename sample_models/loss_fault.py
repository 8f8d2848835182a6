"""NaN made inside the loss: a binary cross-entropy written by hand, sigmoid then log.

The logits reach 13 (3% of them above 8.3 at the initial weights). In FP16, sigmoid(x) rounds
to exactly 1.0 once e^-x is below half an ulp of 1 (2^-12, x > 8.3), so log(1 - p) is -inf and (1 - t) * log(1 - p) is 0 * -inf = NaN for
positive labels. In FP32 sigmoid stays below 1.0 up to x ≈ 16.6, and the loss is finite. Every
module output is finite: the fault is in the loss function.

    ampdoctor triage sample_models/loss_fault.py   # verdict: fp16_forward_overflow, module None (op: log)
"""

import torch
from torch import nn


def build_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        m[2].weight.mul_(12.0)  # confident logits: |x| reaches 13
    return m


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, generator=g)
    out = []
    for _ in range(8):
        x = torch.randn(64, 16, generator=g)
        out.append((x, (x @ w > 0).float().unsqueeze(1)))
    return out


def loss_fn(logits, target):
    p = torch.sigmoid(logits)
    return -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()
