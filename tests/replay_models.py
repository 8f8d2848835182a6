"""Models the spec-free replay tests rebuild by import path (``tests.replay_models.Diffusion``): a class the
capture's ``model_identity`` names must be importable where the replay runs."""

from __future__ import annotations

import torch
from torch import nn


class Diffusion(nn.Module):
    """A diffusion-style denoiser whose loss draws the timestep inside the step (``torch.randint`` in
    ``forward``): the noise level grows with t, and for the top timesteps the scaled input passes FP16's
    65504 in the first layer, so only some draws overflow."""

    T = 1000

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.out = nn.Linear(32, 8)
        with torch.no_grad():
            self.inp.weight.copy_(torch.randn(32, 8, generator=g) * 0.3)
            self.out.weight.copy_(torch.randn(8, 32, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        t = torch.randint(0, self.T, (1,))  # drawn in the step, as a diffusion loss draws it
        level = torch.where(t >= 900, torch.tensor(3e4), torch.tensor(1.0))  # the last timesteps: a huge scale
        noise = torch.randn_like(x)
        h = torch.relu(self.inp(x * level + noise))
        pred = self.out(h)
        return {"loss": ((pred.float() - noise) ** 2).mean(), "t": t}
