"""An LSTM: trains on CUDA under autocast, but CPU autocast FP16 has no oneDNN LSTM kernel.
On the CPU the report says so (verdict: inconclusive), instead of blaming a NaN.

    ampdoctor triage sample_models/lstm_cpu.py --device cpu
"""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h, _ = self.encoder(x)
        return self.head(h[:, -1])


def build_model() -> nn.Module:
    return Net()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 5, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]


def loss_fn(output, target):
    return nn.functional.mse_loss(output.float(), target)
