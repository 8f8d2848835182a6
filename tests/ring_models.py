"""Healthy runs of several shapes for the lookback forecast's silence, and a trainer for them.

Each builder returns (model, batch(step) -> (x, y), loss_fn, optimizer builder, scheduler builder or None).
None of these runs goes non-finite; the forecast must say nothing on any of them."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .conftest import SAMPLES


def healthy_mlp() -> tuple[Any, ...]:
    """``sample_models/healthy.py`` as it is, with the AdamW triage gives a spec without an optimizer."""
    sys.path.insert(0, str(SAMPLES))
    try:
        import healthy
    finally:
        sys.path.remove(str(SAMPLES))
    torch.manual_seed(0)
    data = healthy.build_dataloader()
    return (healthy.build_model(), lambda s: data[s % len(data)], healthy.loss_fn,
            lambda p: torch.optim.AdamW(p, lr=1e-3), None)


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(self.pool(h).flatten(1))


def healthy_cnn() -> tuple[Any, ...]:
    """A small CNN classifying which quadrant of a noisy 12x12 image holds a bright blob (SGD with momentum)."""
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(16):
        y = torch.randint(0, 4, (16,), generator=g)
        x = 0.3 * torch.randn(16, 1, 12, 12, generator=g)
        for i, q in enumerate(y.tolist()):
            r, c = divmod(q, 2)
            x[i, 0, 6 * r: 6 * r + 6, 6 * c: 6 * c + 6] += 1.0
        batches.append((x, y))
    return (_CNN(), lambda s: batches[s % len(batches)], lambda o, t: nn.functional.cross_entropy(o.float(), t),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), None)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).float().softmax(-1).to(v.dtype)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, d))


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(d), "attn": _Attention(d, 4),
                                                   "ln2": nn.LayerNorm(d), "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(),
                                                                                               nn.Linear(4 * d, d))})
                                    for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln"](x))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.head(x)


def healthy_transformer() -> tuple[Any, ...]:
    """A two-block causal LM on noisy copy sequences, AdamW with 50 steps of linear warm-up then cosine decay:
    noisy but stable (a fifth of the tokens are random)."""
    torch.manual_seed(2)
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(16):
        base = torch.randint(0, 32, (8, 1), generator=g)
        ids = (base + torch.arange(17)) % 32
        noise = torch.rand(8, 17, generator=g) < 0.2
        ids = torch.where(noise, torch.randint(0, 32, (8, 17), generator=g), ids)
        batches.append((ids[:, :-1], ids[:, 1:]))

    def loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(o.float().reshape(-1, o.shape[-1]), t.reshape(-1))

    def sched(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 50, 0.5 * (1 + math.cos(math.pi * min(s, 1000) / 1000))))

    return (_TinyLM(), lambda s: batches[s % len(batches)], loss, lambda p: torch.optim.AdamW(p, lr=3e-3), sched)


def noisy_mlp() -> tuple[Any, ...]:
    """A regression MLP whose batches change scale (x0.25 to x4) and whose targets carry heavy-tailed noise
    (Student-t, 2 degrees of freedom): every figure jumps about, none trends."""
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 1, generator=g)
    t = torch.distributions.StudentT(2.0)
    batches = []
    for i in range(40):
        x = torch.randn(32, 16, generator=g) * (2.0 ** ((i % 5) - 2))
        batches.append((x, x @ w + t.sample((32, 1))))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return (model, lambda s: batches[s % len(batches)], lambda o, y: nn.functional.mse_loss(o.float(), y),
            lambda p: torch.optim.Adam(p, lr=1e-3), None)


HEALTHY: dict[str, Callable[[], tuple[Any, ...]]] = {
    "healthy.py": healthy_mlp, "cnn": healthy_cnn, "transformer": healthy_transformer, "noisy_mlp": noisy_mlp}


def train(build: Callable[[], tuple[Any, ...]], steps: int, **monitor: Any) -> tuple[Any, int | None, list[str]]:
    """AMP + GradScaler + Monitor over ``steps`` steps. Returns the monitor, the first non-finite loss's step
    and the forecast warnings seen."""
    from ampdoctor.engine.monitor import Monitor
    from ampdoctor.engine.ring import ForecastWarning

    model, batch, loss_fn, make_opt, make_sched = build()
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched is not None else None
    scaler = torch.amp.GradScaler("cpu")
    bad = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Monitor(model, opt, scaler, alert_min_steps=10**9, **{"quiet": True, **monitor}) as mon:
            for s in range(steps):
                x, y = batch(s)
                with mon.autocast():
                    loss = loss_fn(model(x), y)
                rec = mon.step(loss, batch=(x, y))
                if sched is not None:
                    sched.step()
                if rec.skip_reason == "nonfinite_loss" and bad is None:
                    bad = rec.step
    return mon, bad, [str(w.message) for w in seen if issubclass(w.category, ForecastWarning)]
