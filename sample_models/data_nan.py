"""A healthy model fed one corrupt batch: batch 7 has NaN in sample 3 of its inputs.

    ampdoctor triage sample_models/data_nan.py       # verdict: data, batch 7
"""

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(12):
        x = torch.randn(32, 16, generator=g)
        y = x.sum(dim=1, keepdim=True)
        if i == 7:
            x[3, 5] = float("nan")  # a missing value that slipped through preprocessing
        batches.append((x, y))
    return batches


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
