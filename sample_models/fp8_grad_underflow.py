"""A summed main loss on a target in raw units beside an auxiliary loss weighted 1e-6: the auxiliary
output's gradients are below E5M2's smallest subnormal once the main loss's gradients set the scale.

The tensorwise recipe casts output gradients to E5M2 with the scale 57344 / amax. E5M2 holds magnitudes
from 57344 down to 2^-16, a span of about 3.8e9: a gradient more than ~7.5e9 times smaller than the
largest in the same tensor is cast to 0. Both losses reach the head through one Linear: the main column's
gradients are ~2e3 (a sum over the batch of errors in thousands), the auxiliary column's ~6e-8 (a mean,
weighted 1e-6), a ratio above 3e10, so the auxiliary ones flush in FP8. BF16 keeps them, and they are
above AdamW's eps (1e-8), so Adam, which divides by the gradient's own size, trains the auxiliary output
in BF16; in FP8 its row of the head gets no gradient.

    ampdoctor triage sample_models/fp8_grad_underflow.py --target fp8  # verdict: fp8_grad_underflow, head
"""

import torch
from torch import nn

AUX_WEIGHT = 1e-6


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.head = nn.Linear(32, 2)  # column 0: the main target, column 1: the auxiliary one

    def forward(self, x):
        return self.head(self.body(x))


def build_model() -> nn.Module:
    return TwoHeads()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 2, generator=g)
    scale = torch.tensor([1000.0, 1.0])  # the main target in raw units (thousands), the auxiliary one normalised
    return [(x, (x @ w) * scale) for x in (torch.randn(32, 16, generator=g) for _ in range(8))]


def loss_fn(output, target):
    main = nn.functional.mse_loss(output[:, 0], target[:, 0], reduction="sum")
    aux = nn.functional.mse_loss(output[:, 1], target[:, 1])
    return main + AUX_WEIGHT * aux
