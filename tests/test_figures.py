"""The Monitor's figures for the user's tracker (``on_record``, TensorBoard, the Trainer's logs) and the save-time
warning: what they say, and that the run stays bit-identical with them on."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ampdoctor import Monitor
from ampdoctor.errors import UsageError

from .test_transparency import _run, _same


@pytest.mark.parametrize(("opt_name", "driver"), [("adamw_fused", "observe"), ("adamw_fused", "owned"),
                                                  ("adam_forloop", "owned"), ("sgd_momentum", "observe")])
@pytest.mark.parametrize("fault", ["none", "nan_loss", "inf_grad", "nan_batch"])
def test_figures_change_nothing(opt_name: str, driver: str, fault: str) -> None:
    got: list[tuple[int, dict[str, float]]] = []
    # (owned with clipping: the monitor clips with its own norm, compared within rounding in test_transparency)
    kw: dict[str, Any] = dict(scaler_on=True, clip=driver == "observe", accum=1, mode="full", fault=fault, fault_step=3, steps=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = _run(opt_name, driver, capture=None, watched=False, **kw)
        seen = _run(opt_name, driver, capture=None, watched=True, extra={"on_record": lambda s, f: got.append((s, f))}, **kw)
    _same(bare, seen)
    assert [s for s, _ in got] == list(range(8))
    assert all("ampdoctor/headroom_min" in f and f["ampdoctor/scale"] > 0 for _, f in got)
    if fault in ("inf_grad", "nan_batch") or (fault == "nan_loss" and driver == "owned"):  # a skip (observed, a NaN
        # loss with finite gradients is applied: GradScaler skips only on non-finite gradients), counted by its reason
        assert sum(f["ampdoctor/skips"] for _, f in got) >= 1
        assert any(k.startswith("ampdoctor/skips/nonfinite") for _, f in got for k in f)


def test_headroom_names_the_tightest_layer() -> None:
    """A layer whose output is 2^12 has 65504/4096 ~ 2^4 of FP16 headroom; the others far more."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.Linear(4, 4)
            self.big = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.big(torch.tanh(self.small(x)))

    m = Net()
    with torch.no_grad():
        m.big.weight.fill_(0.0)
        m.big.bias.fill_(4096.0)
    got: list[dict[str, float]] = []
    mon = Monitor(m, torch.optim.SGD(m.parameters(), lr=0.0), on_record=lambda s, f: got.append(f))
    mon.step(m(torch.randn(8, 4)).mean() * 0)
    mon.close()
    f = got[0]
    assert f["ampdoctor/headroom/big"] == f["ampdoctor/headroom_min"] == pytest.approx(math.log2(65504 / 4096))
    assert "ampdoctor/scale" not in f  # no GradScaler


def test_on_record_that_raises_turns_only_the_figures_off(caplog: pytest.LogCaptureFixture) -> None:
    m = nn.Linear(4, 1)
    calls = {"n": 0}

    def bad(step: int, figs: dict[str, float]) -> None:
        calls["n"] += 1
        raise KeyError("oops")

    mon = Monitor(m, torch.optim.SGD(m.parameters(), lr=0.1), on_record=bad)
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        for _ in range(3):
            mon.step(m(torch.randn(2, 4)).sum())
    assert calls["n"] == 1 and mon.off is None and mon.last is not None and mon.last.step == 2
    assert sum("on_record raised KeyError" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(UsageError, match="on_record takes a function"):
        Monitor(m, None, on_record=3)


def test_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from ampdoctor.integrations.tensorboard import scalars

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    writer = SummaryWriter(str(tmp_path / "tb"))
    sc = torch.amp.GradScaler("cpu")
    mon = Monitor(m, torch.optim.Adam(m.parameters()), sc, on_record=scalars(writer, every=2))
    for _ in range(6):
        with mon.autocast():
            loss = m(torch.randn(8, 4)).float().pow(2).mean()
        mon.step(loss)
    mon.close()
    writer.close()
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"ampdoctor/headroom_min", "ampdoctor/scale", "ampdoctor/skips", "ampdoctor/skip_rate"} <= tags
    assert [e.step for e in ea.Scalars("ampdoctor/scale")] == [0, 2, 4]
    with pytest.raises(UsageError):
        scalars(object())


# ---------------------------------------------------------------------------------------------- save-time warning


def _own_loop(mon: Monitor | None, model: nn.Module, opt: torch.optim.Optimizer, nan_at: int, saves: list[int],
              said: list[Any]) -> None:
    """A plain fp32 loop (no GradScaler: a NaN step is applied) that saves at ``saves``."""
    for step in range(12):
        x = torch.randn(8, 4)
        if step == nan_at:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        loss.backward()
        if mon is not None:
            mon.after_backward(loss)
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.after_step()
            if step in saves:
                said.append((step, mon.saving(f"ckpt-{step}.pt")))


def test_a_save_after_an_applied_nonfinite_update_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    said: list[Any] = []
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        _own_loop(Monitor(model, opt, quiet=False), model, opt, nan_at=5, saves=[3, 7, 9], said=said)
    assert said[0] == (3, None)
    step, msg = said[1]
    assert step == 7 and msg.startswith("ampdoctor: saving to ckpt-7.pt: the state holds NaN/Inf in 0.weight, 0.bias, 2.weight")
    assert "step 5 applied a non-finite update (nonfinite_loss)" in msg
    assert said[2] == (9, None)  # once a run
    assert sum("saving to" in r.getMessage() for r in caplog.records) == 1


def test_saving_changes_nothing() -> None:
    def run(watched: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters())
        mon = Monitor(model, opt, quiet=True) if watched else None
        _own_loop(mon, model, opt, nan_at=5, saves=list(range(12)), said=[])
        return {**model.state_dict(), **{f"opt{i}{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()}}

    bare, seen = run(False), run(True)
    assert bare.keys() == seen.keys()
    assert all(torch.equal(bare[k], seen[k]) or (bare[k].isnan() == seen[k].isnan()).all() for k in bare)


def test_a_clean_state_with_nonfinite_weights_from_a_finite_step_is_caught() -> None:
    """Weights that overflow in an update with finite gradients (no applied non-finite step): the state is checked."""
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1e38)
    mon = Monitor(m, opt, quiet=True)
    for _ in range(2):
        mon.step(m(torch.full((2, 4), 1e3)).sum())
    msg = mon.saving()
    assert msg is not None and "the state holds NaN/Inf in weight;" in msg and "no step up to 1 applied a non-finite gradient" in msg
