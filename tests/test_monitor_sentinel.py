"""Monitor(mode="sentinel"): a cheap check every step, full statistics on a schedule and after a trip."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from ampdoctor import Monitor
from ampdoctor.errors import UsageError
from ampdoctor.watch.calls import watchers

from .test_monitor import sync_counter, tiny  # noqa: F401 - the fixture is used by name


def test_full_every_and_the_steps_after_a_trip() -> None:
    model, x, y = tiny()
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    recs = []
    with Monitor(model, opt, sc, mode="sentinel", full_every=5, full_after=2, inject_inf_at=7) as mon:
        for _ in range(14):
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            recs.append(mon.step(loss))
            assert bool(watchers()) == mon.hooks.recording  # no hook on a sentinel step
    full = [r.step for r in recs if r.stats is not None and r.stats.act]
    assert full == [0, 5, 8, 9, 10]  # every 5th, and the 2 steps after the trip at 7
    trip = recs[7]
    assert trip.tripped and trip.skipped and trip.skip_reason == "nonfinite_grad:0"
    assert trip.nonfinite_params == ["0.weight"]
    assert trip.stats is not None and set(trip.stats.pgrad) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert trip.stats.pgrad["0.weight"][6] == 1  # Col.POSINF: the injected Inf, counted in full
    assert not trip.stats.act  # the trip is known after the forward: its activations were not recorded
    assert [r.step for r in recs if r.tripped] == [7]


def test_a_gradient_fp16_cannot_hold_trips_it_without_a_skip() -> None:
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with Monitor(model, opt, mode="sentinel", full_every=100, full_after=1) as mon:  # fp32 training, FP16 format
        recs = []
        for i in range(4):
            loss = nn.functional.mse_loss(model(x), y * (1e7 if i == 2 else 1.0))  # gradients beyond 65504
            recs.append(mon.step(loss))
    assert [r.tripped for r in recs] == [False, False, True, False]
    assert not any(r.skipped for r in recs)
    st = recs[2].stats
    assert st is not None and max(row[9] for row in st.pgrad.values()) > 65504  # Col.ABSMAX
    assert recs[3].stats is not None and recs[3].stats.act  # full_after=1


def test_one_host_copy_per_sentinel_step(sync_counter: collections.Counter[str]) -> None:  # noqa: F811
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    with Monitor(model, opt, sc, mode="sentinel", full_every=100, full_after=1, inject_inf_at=2) as mon:
        for i in range(5):
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            sc.scale(loss).backward()
            sync_counter.clear()
            mon.after_backward(loss)
            # the sentinel rides in the monitor's one copy; a trip (step 2) takes a second for its statistics
            assert sum(sync_counter.values()) == (2 if i == 2 else 1), (i, dict(sync_counter))
            sc.step(opt)
            sc.update()
            mon.after_step()
            opt.zero_grad(set_to_none=True)


def test_bad_sentinel_options() -> None:
    model, _, _ = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(UsageError, match="mode"):
        Monitor(model, opt, mode="always")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="full_every"):
        Monitor(model, opt, mode="sentinel", full_every=0)


def test_the_own_loop_page_example(capsys: pytest.CaptureFixture[str]) -> None:
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "own-loop.md").read_text()
    sec = doc[doc.index("## Always on: sentinel mode"):]
    code = re.search(r"```py\n(.*?)```", sec, flags=re.S)
    shown = re.search(r"On the CPU it prints:\n\n```\n(.*?)```", sec, flags=re.S)
    assert code is not None and shown is not None
    exec(compile(code.group(1), "own-loop.md#sentinel", "exec"), {"__name__": "__doc_example__"})
    assert capsys.readouterr().out == shown.group(1)
