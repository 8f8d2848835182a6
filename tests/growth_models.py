"""Runs that fail late by growth the module outputs do not show (issue 44 item 4), and a trainer for them.

Each builder returns (model, batch(step) -> (x, y), loss_fn, optimizer builder); the trainer runs the user's plain
AMP loop (autocast, GradScaler's defaults, a Monitor) until the Monitor's first failure. How each fails:

- ``attention_logits``: one attention layer whose softmax runs at a temperature of 4096 (the raw product is divided
  after it is made, as ``1 / sqrt(d)`` is); Adam grows the q and k projections to sharpen it, and the raw
  ``q @ k^T`` passes 65504 inside the module (an ``inf`` logit, a NaN softmax, a NaN loss) while the module's
  output, a softmax-weighted mean of ``v``, stays near 1.
- ``head_seq_warmup``: a head trained on frozen features (a pretrained projection of inputs in raw units, spread
  430) with a cross-entropy summed over the tokens, under a sequence-length warm-up (64 more tokens each step) and
  noisy labels. The head's weight gradient is a sum over the tokens of feature x (p - y): it grows with the length
  (as its square root: the terms do not share a sign) until, unscaled, it passes 65504, and GradScaler skips at a
  scale of 1 or less.
- ``sum_loss_doubling``: a regression whose targets double every 25 steps (a curriculum in the target's units),
  predicted in hundreds (the loss multiplies the output by 100) with a squared error summed in FP32. The
  gradient at the head's output is ``200 (100 out - y)``: it passes 65504 while the output itself stays far below.
- ``fp16_sum_loss``: targets that double every 40 steps, the squared error summed in FP16 (the targets cast to the
  output's dtype): the loss itself passes 65504 first, a non-finite loss.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

T_ATTN = 4096.0


class TempAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.k(x).transpose(-2, -1)
        p = torch.softmax(s.float() / T_ATTN, -1).to(s.dtype)
        return p @ self.v(x)


class AttnNet(nn.Module):
    def __init__(self, d: int = 16, classes: int = 8) -> None:
        super().__init__()
        self.attn = TempAttention(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def attention_logits() -> tuple[Any, ...]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g)
    batches = []
    for _ in range(32):
        x = torch.randn(8, 12, 16, generator=g)
        batches.append((x, (x @ w).argmax(-1)))

    def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(o.float().reshape(-1, o.shape[-1]), y.reshape(-1))

    return AttnNet(), lambda s: batches[s % len(batches)], loss, lambda p: torch.optim.Adam(p, lr=3e-2)


class FrozenBodyHead(nn.Module):
    def __init__(self, d: int = 8, h: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Linear(d, h)
        self.body.requires_grad_(False)
        self.head = nn.Linear(h, classes)
        nn.init.zeros_(self.head.weight)  # a new head starts from zero (uniform predictions)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def head_seq_warmup() -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = FrozenBodyHead()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        n = 64 * (step + 1)  # the warm-up: 64 more tokens each step
        x = 430.0 * torch.randn(1, n, 8, generator=g)  # raw units: zero mean, a spread of 430
        return x, torch.randint(0, 4, (1, n), generator=g)

    def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(o.float().reshape(-1, o.shape[-1]), y.reshape(-1), reduction="sum")

    return model, batch, loss, lambda p: torch.optim.AdamW([q for q in p if q.requires_grad], lr=1e-6)


def _doubling(every: float) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step % 16)
        x = torch.randn(16, 8, generator=g)
        return x, (1.0 + x[:, :1].abs()) * 2.0 ** (step / every)  # the targets double every ``every`` steps
    return batch


def _regressor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def sum_loss_doubling() -> tuple[Any, ...]:
    def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((o.float() * 100.0 - y) ** 2).sum()  # predicted in hundreds, summed in FP32

    return _regressor(), _doubling(25.0), loss, lambda p: torch.optim.Adam(p, lr=1e-2)


def fp16_sum_loss() -> tuple[Any, ...]:
    def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((o - y.to(o.dtype)) ** 2).sum()  # summed in the output's dtype: FP16 under autocast

    return _regressor(), _doubling(40.0), loss, lambda p: torch.optim.Adam(p, lr=1e-2)


GROWTH: dict[str, Callable[[], tuple[Any, ...]]] = {
    "attention_logits": attention_logits, "head_seq_warmup": head_seq_warmup,
    "sum_loss_doubling": sum_loss_doubling, "fp16_sum_loss": fp16_sum_loss}


def run(build: Callable[[], tuple[Any, ...]], steps: int, **monitor: Any) -> tuple[Any, list[str]]:
    """The user's loop with a Monitor (GradScaler's defaults) until its first failure or ``steps``. Returns the
    monitor and the forecast warnings said."""
    from ampdoctor import Monitor
    from ampdoctor.engine.ring import ForecastWarning

    model, batch, loss_fn, make_opt = build()
    opt = make_opt(model.parameters())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Monitor(model, opt, torch.amp.GradScaler("cpu"), **{"quiet": False, "alert_min_steps": 10**9, **monitor}) as mon:
            for s in range(steps):
                x, y = batch(s)
                with mon.autocast():
                    loss = loss_fn(model(x), y)
                mon.step(loss)
                if mon.first_failure is not None:
                    break
    return mon, [str(w.message) for w in seen if issubclass(w.category, ForecastWarning)]
