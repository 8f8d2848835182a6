"""``ampdoctor.integrations.accelerate.watch``: an accelerate loop, unchanged but for one line.

On the CPU accelerate makes no GradScaler for fp16; the test hands the ``Accelerator`` the
``torch.amp.GradScaler("cpu")`` and autocast it would make on a GPU (``scaler``, ``native_amp``)
before ``prepare``, so ``accelerator.backward`` scales and the prepared optimizer steps through it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

from ampdoctor.integrations.accelerate import watch  # noqa: E402
from ampdoctor.watch.steplog_read import read_step_log  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> None:
    """accelerate keeps one process-wide state: a run with another mixed precision (an earlier test)
    would make this one's Accelerator refuse to start."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(x)))


def _run(tmp: Path, accumulate: int, bad: int, fused: bool = False, watched: bool = True) -> tuple[object, list[float]]:
    acc = Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=accumulate)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # what accelerate makes on a GPU
    acc.native_amp = True
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(8 * 8, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
    xs[8 * bad, 0] = float("inf")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8)
    model, opt, data = acc.prepare(model, opt, data)
    mon = watch(acc, model, opt, log=tmp / "steps.csv", capture=tmp / "cap") if watched else None
    losses = []
    for x, y in data:  # the user's loop, unchanged
        with acc.accumulate(model):
            loss = nn.functional.cross_entropy(model(x).float(), y)
            losses.append(loss.item())
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    if mon is not None:
        mon.close()
    assert "step" not in vars(opt) and "backward" not in vars(acc)  # unwrapped
    if not watched:
        return model, losses
    return mon, losses


def test_watch_logs_every_optimizer_step(tmp_path: Path) -> None:
    mon, losses = _run(tmp_path, accumulate=1, bad=5)
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    assert log.index.tolist() == list(range(8))
    assert log.loc[5, "skip_reason"] == "nonfinite_loss" and log["skipped"].sum() == 1
    assert np.allclose(log.drop(index=5)["loss"], np.delete(losses, 5), rtol=1e-6)
    assert (tmp_path / "cap" / "manifest.json").exists()


def test_watch_with_gradient_accumulation(tmp_path: Path) -> None:
    mon, losses = _run(tmp_path, accumulate=2, bad=5)  # batch 5: the second micro-batch of step 2
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    assert log.index.tolist() == [0, 1, 2, 3]
    assert log.loc[2, "skip_reason"] == "nonfinite_loss"
    # the logged loss of a step is the mean of its micro-batches' losses, as accelerate backpropagates it
    assert np.isclose(log.loc[0, "loss"], (losses[0] + losses[1]) / 2, rtol=1e-6)


def test_fused_adamw_run_is_bit_identical_with_and_without_watch(tmp_path: Path) -> None:
    from accelerate.state import AcceleratorState

    bare, _ = _run(tmp_path / "bare", accumulate=1, bad=5, fused=True, watched=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    mon, _ = _run(tmp_path / "seen", accumulate=1, bad=5, fused=True)
    seen = mon.model  # type: ignore[attr-defined]
    for a, b in zip(bare.parameters(), seen.parameters(), strict=True):  # type: ignore[attr-defined]
        assert torch.isfinite(b).all() and torch.equal(a, b)
    assert read_step_log(tmp_path / "seen" / "steps.csv").frame["skipped"].sum() == 1


def test_close_undoes_the_class_swap_and_the_wrapped_methods(tmp_path: Path) -> None:
    from ampdoctor.engine.monitor import Monitor
    from ampdoctor.integrations.accelerate import _Watch

    acc = Accelerator(cpu=True)
    net = Net()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    plain_step, plain_backward = type(opt).step, type(acc).backward
    mon = watch(acc, model, opt, log=tmp_path / "steps.csv")
    assert type(mon) is _Watch and "step" in vars(opt) and "backward" in vars(acc)
    acc.backward(model(torch.ones(2, 16)).sum())
    opt.step()
    opt.zero_grad()
    assert mon.step_num == 1 and mon.last is not None and mon.last.step == 0
    mon.close()
    assert type(mon) is Monitor and "_restore" not in vars(mon) and "_attached" not in vars(mon)
    assert "step" not in vars(opt) and "backward" not in vars(acc)
    assert type(opt).step is plain_step and type(acc).backward is plain_backward
    mon.close()  # closing it again is safe
    acc.backward(model(torch.ones(2, 16)).sum())  # the loop runs on, unwatched
    opt.step()
    assert mon.step_num == 1
