"""AMP defeated by a "safety" hook: every parameter gradient goes through nan_to_num, so the
infs that GradScaler's 65536 scale produces are zeroed before unscale_ can see them. The scaler
never backs off, the overflowing gradients are silently dropped, and AMP stops learning while
FP32 and raw FP16 (no scale, no overflow) train.

    ampdoctor triage sample_models/amp_misuse.py   # verdict: amp_misuse
"""

import torch
from torch import nn


def build_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    for p in model.parameters():
        # "guard against NaN": hides overflows from GradScaler
        p.register_hook(lambda g: torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0))
    return model


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 16, generator=g), 3 * torch.randn(64, 4, generator=g)) for _ in range(8)]


def loss_fn(output, target):
    return (output.float() - target).pow(2).sum()
