"""A precision-independent bug: log of a ReLU output is log(0) = -inf, in FP32 too.

    ampdoctor triage sample_models/model_bug.py      # verdict: model_bug, module log_features, step 0
"""

import torch
from torch import nn


class LogFeatures(nn.Module):
    def forward(self, x):
        return torch.log(torch.relu(x))  # bug: log(0) for every non-positive input


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.log_features = LogFeatures()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.log_features(self.proj(x)))


def build_model() -> nn.Module:
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)]


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
