"""A per-step random draw: a denoiser that draws its timestep in its own training forward, as diffusion models do,
from 192; the schedule's last timestep has sigma 2e5. The step that draws it makes the noisy input so large that the
first layer's FP16 output passes 65504: a forward overflow at whichever step draws it (1 in 192). A replay with the
run's RNG state draws the same timestep."""

import torch
from torch import nn

T = 192


def sigma(t: int) -> float:
    """The noise schedule: 0.5, except its last timestep, sigma_max = 2e5 (a schedule that was never clipped)."""
    return 2e5 if t == T - 1 else 0.5


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.body = nn.Sequential(nn.SiLU(), nn.Linear(32, 32), nn.SiLU())
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        t = int(torch.randint(0, T, ()))  # the timestep, drawn in the step
        noisy = x + torch.randn_like(x) * sigma(t)
        return self.out(self.body(self.inp(noisy))), x


def build_model():
    torch.manual_seed(0)
    return Denoiser()


def batch(step: int, g: torch.Generator):
    return (torch.randn(16, 8, generator=g),)


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [batch(s, g) for s in range(4)]


def loss_fn(out, target):
    pred, clean = out
    return nn.functional.mse_loss(pred.float(), clean) 


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-3)
