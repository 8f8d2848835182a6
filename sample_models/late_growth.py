"""A late overflow of another shape: one linear head whose output grows linearly, not quadratically.

The hidden features are fixed (a frozen projection and a ReLU) and Adam moves every head weight by about
its learning rate a step towards a target of 1e5, so the head's output climbs by roughly the same amount
every step, passes FP16's max (65504) after a few hundred steps, and the loss goes non-finite. Unlike
``late_overflow.py`` (two growing projections multiplied: quadratic growth, a custom matmul module), here
the growth is linear in value and the layer is a plain ``nn.Linear`` named ``head``:

    python sample_models/late_growth.py --capture cap       # the forecast names head well before the failure
    ampdoctor triage sample_models/late_growth.py --from cap
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict

import torch
from torch import nn

TARGET = 1e5


def build_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(OrderedDict(proj=nn.Linear(16, 64), act=nn.ReLU(), head=nn.Linear(64, 4)))
    m.proj.requires_grad_(False)  # fixed features: only the head learns
    return m


def build_dataloader() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(16.0 * torch.randn(16, 16, generator=g), torch.ones(16, 4)) for _ in range(32)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() / TARGET - target.float()).pow(2).mean()


def build_optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return torch.optim.Adam([p for p in params if p.requires_grad], lr=1.0)


def train(steps: int, capture: str | None = None, **monitor: object) -> tuple[int | None, object]:
    """The user's loop (AMP + GradScaler + Monitor). Returns the first non-finite loss's step and the monitor."""
    from ampdoctor import Monitor

    model = build_model()
    opt = build_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    data = build_dataloader()
    first_bad = None
    with Monitor(model, opt, scaler, capture=capture, **monitor) as mon:  # type: ignore[arg-type]
        for step in range(steps):
            x, y = data[step % len(data)]
            with mon.autocast():
                loss = loss_fn(model(x), y)
            rec = mon.step(loss, batch=(x, y))
            if rec.skip_reason == "nonfinite_loss" and first_bad is None:
                first_bad = rec.step
    return first_bad, mon


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--capture", default=None)
    a = ap.parse_args(argv)
    bad, _ = train(a.steps, a.capture)
    print("no failure" if bad is None else f"first non-finite loss at step {bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
