"""Host syncs per Monitor step on CUDA, counted with torch.cuda.set_sync_debug_mode (marker ``cuda``; skipped
without a CUDA device). The budget is what docs/architecture.md promises: the step's one host copy, plus
GradScaler's own sync in ``scaler.step`` (its found-inf check)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ampdoctor import Monitor

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 1)).cuda()


def _syncs(fn: object) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fn()  # type: ignore[operator]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum(1 for x in w if "synchroniz" in str(x.message).lower())


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_monitor_step_syncs_at_most_twice(mode: str) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sc = torch.amp.GradScaler("cuda")
    mon = Monitor(model, opt, sc, mode=mode, quiet=True)  # type: ignore[arg-type]
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 1, device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        mon.step(loss)

    for _ in range(3):  # warm-up: first steps allocate, the sentinel's full step 0
        step()
    counts = [_syncs(step) for _ in range(5)]
    mon.close()
    assert max(counts) <= 2, counts


def test_the_observing_driver_adds_at_most_one_sync() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sc = torch.amp.GradScaler("cuda")
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 1, device="cuda")

    def bare() -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        bare()
    base = _syncs(bare)
    mon = Monitor(model, opt, sc, quiet=True)

    def watched() -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        sc.scale(loss).backward()
        mon.after_backward(loss)
        sc.step(opt)
        sc.update()
        mon.after_step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        watched()
    counts = [_syncs(watched) for _ in range(5)]
    mon.close()
    assert max(counts) <= base + 1, (base, counts)
