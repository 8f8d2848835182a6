"""One row of every batch is 10^6 times the others: under tensorwise scaling it sets the scale of the whole
input, and the other rows fall below E4M3's smallest subnormal.

A tensorwise FP8 cast scales the tensor by 448 / amax. E4M3 holds magnitudes from 448 down to 2^-9, a span
of 448 * 2^9 ≈ 2.3e5 (17.8 binades): a row 10^6 times smaller than the largest is cast to 0. Here each batch
starts with a summary row in raw units (a sum over 10^6 readings) next to normalised rows: FP8 trains the
first Linear on the summary row only (the others give its bias, the same for every row, which the LayerNorm
after it cannot tell apart), while BF16, which has FP32's exponent range, keeps every row. One scale per row
(the rowwise recipe) keeps them.

    ampdoctor triage sample_models/fp8_outlier_row.py --target fp8     # verdict: fp8_flush, input of 0
"""

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    batches = []
    for _ in range(8):
        x = torch.randn(32, 16, generator=g)
        x[0] = x[0].abs() * 1e6  # the summary row, in raw units
        y = torch.tanh(x @ w)
        batches.append((x, y))
    return batches


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
