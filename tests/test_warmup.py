"""While the statistics kernel builds, a full-mode Monitor on the CPU keeps its sentinel checks and skips the
per-module statistics; a tripped step and every step once the kernel is ready are recorded in full."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from ampdoctor import Monitor
from ampdoctor.watch import fused


def _loop(monkeypatch: pytest.MonkeyPatch, ready_from: int, nan_at: int | None, steps: int = 8) -> list[Any]:
    monkeypatch.setenv("AMPDOCTOR_WARMUP", "sentinel")
    state = {"step": 0}
    monkeypatch.setattr(fused, "pending", lambda: state["step"] < ready_from)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    mon = Monitor(model, opt, sc, quiet=True, full_after=1)
    recs = []
    for i in range(steps):
        state["step"] = i
        x = torch.randn(4, 8)
        if i == nan_at:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        recs.append(mon.step(loss))
    mon.close()
    return recs


def _full(rec: object) -> bool:
    st = getattr(rec, "stats", None)
    return st is not None and bool(getattr(st, "act", None))


def test_warm_up_skips_module_statistics_until_the_kernel_is_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    recs = _loop(monkeypatch, ready_from=5, nan_at=None)
    full = [_full(r) for r in recs]
    assert full[0]  # step 0 was begun before the build started
    assert not any(full[1:5])  # sentinel checks only while the kernel builds
    # each step's recording is decided as the step before ends: step 5's while the kernel was still building
    assert not full[5] and all(full[6:])  # full statistics on every step once it is ready


def test_a_nan_while_the_kernel_builds_is_recorded_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    recs = _loop(monkeypatch, ready_from=100, nan_at=3)
    assert recs[3].skipped
    assert recs[3].skip_reason.startswith("nonfinite")
    assert _full(recs[4])  # full_after=1: the step after the trip is recorded in full
    assert not _full(recs[6])


def test_warmup_full_keeps_full_statistics_on_the_eager_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "pending", lambda: True)
    monkeypatch.setenv("AMPDOCTOR_WARMUP", "full")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, None, quiet=True)
    for _ in range(3):
        rec = mon.step(model(torch.randn(4, 8)).pow(2).mean())
        assert _full(rec)
    mon.close()


def test_one_builder_per_machine(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second builder finds the lock held and leaves the build to the first (exit status BUSY)."""
    lk = fused._file_lock()
    lk.acquire(timeout=0)
    try:
        assert fused._building_elsewhere()
        p = subprocess.run([sys.executable, "-c", "import sys; from ampdoctor.watch import fused; sys.exit(fused.build_locked())"],
                           capture_output=True, timeout=300)
        assert p.returncode == fused.BUSY, p.stderr
    finally:
        lk.release()
    assert not fused._building_elsewhere()
