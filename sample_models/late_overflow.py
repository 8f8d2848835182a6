"""A run that trains cleanly for hundreds of steps, then goes non-finite.

The attention logits ``q @ k^T`` grow with the weights (the target asks for logits of 1e5) until one
passes FP16's max, 65504, at step 154 (torch 2.13 on the CPU). Nothing is wrong at initialisation, so triage from
the initial weights says `healthy`; the failing step has to be captured in the run and replayed:

    ampdoctor triage sample_models/late_overflow.py                 # 50 steps from init: healthy
    python sample_models/late_overflow.py --capture cap             # trains with a Monitor; captures the failing step
    ampdoctor triage sample_models/late_overflow.py --from cap      # fp16_forward_overflow, logits, at the run's step

As a spec it defines build_model, build_dataloader, loss_fn and build_optimizer; run as a script it
is the user's own training loop (AMP + GradScaler + ampdoctor.Monitor).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

TARGET = 1e5
"""What the diagonal logits are trained towards: beyond FP16's 65504, reached only after many steps."""


class Logits(nn.Module):
    """Attention logits q @ k^T (unscaled)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-2, -1)


class Model(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.logits = Logits()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.q(x), self.k(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def build_dataloader() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # targets in units of TARGET (1.0): the data itself stays well inside FP16's range
    return [(torch.randn(4, 8, 16, generator=g), torch.ones(4, 8)) for _ in range(64)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    diag = out.float().diagonal(dim1=-2, dim2=-1) / TARGET
    return (diag - target.float()).pow(2).mean()


def build_optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return torch.optim.Adam(params, lr=0.05)


def train(steps: int, capture: str | None, log: str | None, device: str = "cpu", tensorboard: str | None = None) -> int | None:
    """The user's loop: AMP + GradScaler with a Monitor. Returns the first skipped step after calibration.
    ``tensorboard``: a folder for the Monitor's figures (``ampdoctor.integrations.tensorboard.scalars``)."""
    from ampdoctor import Monitor

    on_record = None
    if tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter

        from ampdoctor.integrations.tensorboard import scalars

        on_record = scalars(SummaryWriter(tensorboard))

    dev = torch.device(device)
    model = build_model().to(dev)
    opt = build_optimizer(model.parameters())
    scaler = torch.amp.GradScaler(dev.type)
    data = build_dataloader()
    first_bad = None
    with Monitor(model, opt, scaler, log=log, log_mode="overwrite", capture=capture, snapshot_every=100,
                 on_record=on_record) as mon:
        for step in range(steps):
            x, y = data[step % len(data)]
            x, y = x.to(dev), y.to(dev)
            with mon.autocast():
                loss = loss_fn(model(x), y)
            rec = mon.step(loss, batch=(x, y))  # the Monitor itself says the failure and where it captured it
            if rec.skipped and rec.skip_reason == "nonfinite_loss" and first_bad is None:
                first_bad = rec.step
    return first_bad


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--capture", default=None, help="capture folder (ampdoctor triage ... --from it)")
    ap.add_argument("--log", default=None, help="step-log CSV")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tensorboard", default=None, help="write the Monitor's figures to this TensorBoard folder")
    a = ap.parse_args(argv)
    bad = train(a.steps, a.capture, a.log, a.device, a.tensorboard)
    print("no failure" if bad is None else f"first non-finite loss at step {bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
