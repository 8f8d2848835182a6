"""(c3) A tabular classifier that starts with BatchNorm1d on the raw features (the usual tabular recipe), trained
with SGD. -1e7 fills missing values: three readings in batch 1 (rows 0, 9 and 20, feature 3), one in batch 5. Under
AMP the BatchNorm keeps FP32 input in FP32, so the batch statistics absorb the sentinel and the run trains; raw FP16
turns it into -inf at batch 1. The first batch to hold it is the one to name.

    ampdoctor triage tests/unseen/sentinel_batchnorm.py   # data, batch 1 (step 1)
"""

import torch
from torch import nn

FILL = -1e7


def build_model() -> nn.Module:
    torch.manual_seed(9)
    return nn.Sequential(nn.BatchNorm1d(12), nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 3))


def build_dataloader():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(12, 3, generator=g)
    out = []
    for i in range(7):
        x = 2.0 * torch.randn(64, 12, generator=g) + 1.0
        y = (x @ w).argmax(dim=1)
        if i == 1:
            x[[0, 9, 20], 3] = FILL
        if i == 5:
            x[33, 3] = FILL
        out.append((x, y))
    return out


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.float(), target)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
