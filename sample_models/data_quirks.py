"""Data that trains under AMP but holds what FP16 cannot take: the data scan reports it anyway.

* field ``depth`` carries the fill value -999999 for missing readings (the model masks them);
* batch 3 of ``x`` has one sample 10^4 times larger than the rest (a reading in the wrong unit):
  an outlier, and beyond FP16's 65504, so raw FP16 (``model.half()``) turns it into inf at
  step 3 (the failure follows the data), while autocast divides x by 1000 in FP32 first;
* batch 5 of ``x`` holds 2e5 in one element: beyond FP16's range, not an outlier.

    ampdoctor triage sample_models/data_quirks.py   # verdict: healthy, with data findings
"""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 32)
        self.head = nn.Linear(33, 1)

    def forward(self, x, depth):
        d = torch.where(depth > -1000, depth, torch.zeros_like(depth))  # missing readings are masked
        h = torch.tanh(self.enc(x / 1000.0))  # raw sensor units -> O(1)
        return self.head(torch.cat([h, d], dim=-1))


def build_model() -> nn.Module:
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    out = []
    for i in range(8):
        x = torch.randn(32, 16, generator=g) * 1000.0
        depth = torch.rand(32, 1, generator=g)
        depth[torch.rand(32, 1, generator=g) < 0.1] = -999999.0
        if i == 3:
            x[7] *= 1e4  # a reading in the wrong unit
        if i == 5:
            x[2, 4] = 2e5
        out.append({"x": x, "depth": depth, "labels": torch.tanh(x @ w / 1000.0)})
    return out


def loss_fn(output, target):
    return (output.float() - target).pow(2).mean()
