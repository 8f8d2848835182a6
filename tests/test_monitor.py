"""ampdoctor.Monitor on tiny CPU models: the demo, skip reasons, bf16, skip-rate limits, state, syncs."""

from __future__ import annotations

import collections
import importlib.util
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ampdoctor import Monitor
from ampdoctor.engine.monitor import SkipRateError, SkipRateWarning
from ampdoctor.errors import AmpDoctorError, UsageError
from ampdoctor.watch.steplog import COLUMNS
from ampdoctor.watch.steplog_read import read_step_log

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


def load_demo() -> Any:
    spec = importlib.util.spec_from_file_location("skip_demo", SAMPLES / "skip_demo.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(32, 8)
    return model, x, x.sum(1, keepdim=True)


def train(mon: Monitor, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[Any]:
    out = []
    for _ in range(steps):
        with mon.autocast():
            loss = nn.functional.mse_loss(model(x), mon.spike(y))
        out.append(mon.step(loss))
    return out


def test_demo_skips_step_5_and_halves_the_scale(capsys: pytest.CaptureFixture[str]) -> None:
    demo = load_demo()
    assert capsys.readouterr().out == ""  # importing runs nothing
    assert not hasattr(demo, "build_model")  # not a triage spec
    recs = demo.run(steps=20)
    assert len(recs) == 20
    skips = [r.step for r in recs if r.skipped]
    assert skips == [5]
    r5, r6 = recs[5], recs[6]
    assert r5.skip_reason == "nonfinite_grad:0" and r5.nonfinite_params == ["0.weight"]
    assert r5.scale_after == r5.scaler_scale / 2
    assert r6.scaler_scale == r5.scaler_scale / 2 and not r6.skipped  # the next update continues
    assert all(r.scale_after == recs[i + 1].scaler_scale for i, r in enumerate(recs[:-1]))
    assert demo.main(["--steps", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith(("STEP", "SKIP")) for ln in lines) == 20
    assert [ln.split()[1] for ln in lines if ln.startswith("SKIP")] == ["5"]


def test_demo_bf16_skips_nothing() -> None:
    recs = load_demo().run(steps=20, bf16=True, inject_at=None)
    assert not any(r.skipped for r in recs)
    assert all(r.scaler_scale is None for r in recs)


def test_skip_reason_names_the_parameter_and_module() -> None:
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt, torch.amp.GradScaler("cpu", init_scale=256.0), inject_inf_at=2, inject_param="2.weight") as mon:
        recs = train(mon, model, x, y, 4)
    assert [r.skipped for r in recs] == [False, False, True, False]
    assert recs[2].skip_reason == "nonfinite_grad:2"
    assert recs[2].nonfinite_params == ["2.weight"] and recs[2].injected == "inf:2.weight"


@pytest.mark.parametrize("every", [1, 2])
def test_skip_without_scaler_leaves_weights_alone(every: int) -> None:
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt, inject_inf_at=3, inject_param="0.bias", every=every) as mon:
        train(mon, model, x, y, 3)
        before = [p.detach().clone() for p in model.parameters()]
        (r,) = train(mon, model, x, y, 1)
        assert r.skipped and r.skip_reason == "nonfinite_grad:0" and r.nonfinite_params == ["0.bias"]
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        (r,) = train(mon, model, x, y, 1)
        assert not r.skipped
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_loss_spike_and_nonfinite_loss() -> None:
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    with Monitor(model, opt, sc, inject_spike_at=1) as mon:
        recs = train(mon, model, x, y, 3)
        assert recs[1].skipped and recs[1].injected == "spike" and recs[1].skip_reason.startswith("nonfinite_grad")
        assert recs[1].loss > 1e12
        # a NaN loss whose gradients are finite still skips, and the scaler backs off
        scale = recs[2].scale_after
        out = model(x)
        loss = nn.functional.mse_loss(out, y) + torch.tensor(float("nan"))
        r = mon.step(loss)
        assert r.skipped and r.skip_reason == "nonfinite_loss" and r.scale_after == scale / 2
        assert sc.get_scale() == scale / 2


def test_clip_records_pre_and_post_norm() -> None:
    model, x, y = tiny()
    ref = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with Monitor(model, opt, max_norm=0.5) as mon:
        (r,) = train(mon, model, x, y, 1)
    # the same step by hand
    m2, _, _ = tiny()
    nn.functional.mse_loss(m2(x), y).backward()
    pre = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.5)
    assert r.grad_l2_pre_clip == pytest.approx(float(pre), rel=1e-6)
    assert r.grad_l2_post_clip == pytest.approx(min(0.5, float(pre)), rel=1e-5)
    for p0, p1, p2 in zip(ref, model.parameters(), m2.parameters(), strict=True):
        assert torch.allclose(p1, p0 - p2.grad, atol=1e-6)


def test_max_skip_rate_raises_after_patience(tmp_path: Path) -> None:
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    log = tmp_path / "steps.csv"
    mon = Monitor(model, opt, log=log, inject_inf_at=range(100), window=10, max_skip_rate=0.5, patience=5,
                  alert_min_steps=1000)
    with pytest.raises(SkipRateError, match="stayed above max_skip_rate=0.5 for 5 steps") as ei:
        train(mon, model, x, y, 10)
    assert isinstance(ei.value, AmpDoctorError)
    mon.close()
    assert read_step_log(log).steps == [0, 1, 2, 3, 4]  # the step that raised is logged


def test_alert_warns_once_above_rate() -> None:
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt, inject_inf_at={3, 4}, window=10, alert_rate=0.1, alert_min_steps=3) as mon:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            train(mon, model, x, y, 8)
    alerts = [m for m in w if issubclass(m.category, SkipRateWarning)]
    assert len(alerts) == 1 and "(alert_rate 10%)" in str(alerts[0].message)


def test_state_dict_round_trip_and_resumed_log(tmp_path: Path) -> None:
    log = tmp_path / "steps.csv"
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    with Monitor(model, opt, sc, log=log, inject_inf_at={2, 5}) as mon:
        train(mon, model, x, y, 8)
        state = mon.state_dict()
        ledger, diag = mon.ledger(), mon.diagnose()
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"monitor": state, "scaler": sc.state_dict()}, ckpt)
    json.dumps(state)  # plain data
    loaded = torch.load(ckpt)
    sc2 = torch.amp.GradScaler("cpu")
    sc2.load_state_dict(loaded["scaler"])
    with Monitor(model, opt, sc2, log=log, inject_inf_at={9}) as mon2:
        mon2.load_state_dict(loaded["monitor"])
        assert mon2.state_dict() == state
        assert mon2.ledger() == ledger and mon2.diagnose() == diag
        recs = train(mon2, model, x, y, 3)
    assert [r.step for r in recs] == [8, 9, 10]
    assert recs[0].scaler_scale == sc.get_scale()
    assert mon2.total_skips == state["total_skips"] + 1
    log_read = read_step_log(log)
    assert log_read.steps == list(range(11)) and log_read.notes == []
    assert [s for s, k in zip(log_read.steps, log_read.skipped, strict=True) if k][-1] == 9
    assert list(log_read.frame.columns[: len(COLUMNS)]) == list(COLUMNS)


def test_own_loop_hooks() -> None:
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    with Monitor(model, opt, sc, inject_inf_at=1) as mon:
        recs = []
        for i in range(3):
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            sc.scale(loss).backward()
            if i == 2:
                sc.unscale_(opt)  # the user may unscale and clip themselves
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            mon.after_backward(loss)
            sc.step(opt)
            sc.update()
            recs.append(mon.after_step())
            opt.zero_grad(set_to_none=True)
    assert [r.skipped for r in recs] == [False, True, False]
    assert recs[1].scale_after == 128.0 and sc.get_scale() == 128.0
    assert recs[2].grad_l2_post_clip <= 1.0 + 1e-6


def test_own_loop_max_norm_is_a_usage_error() -> None:
    # where the loop steps the optimizer the monitor only observes: it never clips the user's gradients
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt, max_norm=1.0) as mon:
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(UsageError, match="max_norm"):
            mon.after_backward()


def test_hooks_removed_on_close() -> None:
    from ampdoctor.watch.calls import is_wrapped, watchers

    model, _, _ = tiny()

    with Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1)):
        assert watchers() == 1  # one process-wide watch on module calls, nothing on the model
        assert not any(m._forward_hooks for m in model.modules())
    assert watchers() == 0 and not is_wrapped()


# host synchronisations ----------------------------------------------------------------------

SYNCS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__", "numpy")


class _Syncs(collections.Counter[str]):
    """Host reads by method. ``cpu`` and ``numpy`` (a CPU tensor read where it lies: the CPU's host copy) count
    once per calling frame: ``x.cpu().numpy()``, or a step's rows and scalars read in one place, is one copy."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: set[int] = set()

    def clear(self) -> None:
        super().clear()
        self.frames.clear()


@pytest.fixture
def sync_counter(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Count Tensor methods that copy to the host; CPU-only constants built in stats._boundaries are not syncs."""
    counts = _Syncs()
    for name in SYNCS:
        orig = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
            frame = sys._getframe(1)
            copy = _name in ("cpu", "numpy")
            if frame.f_code.co_name != "_boundaries" and not (copy and id(frame) in counts.frames):
                counts[_name] += 1
                if copy:
                    counts.frames.add(id(frame))
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    yield counts


@pytest.mark.parametrize("every", [1, 3])
def test_one_host_sync_per_step(sync_counter: collections.Counter[str], every: int) -> None:
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    with Monitor(model, opt, sc, every=every, inject_inf_at=2) as mon:
        for i in range(4):
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            sc.scale(loss).backward()
            sync_counter.clear()
            mon.after_backward(loss)
            assert sum(sync_counter.values()) == 1, dict(sync_counter)  # the monitor's one copy
            sync_counter.clear()
            sc.step(opt)
            sc.update()
            applied = sum(sync_counter.values())
            sync_counter.clear()
            r = mon.after_step()
            assert sum(sync_counter.values()) == 0
            assert applied == 1 and r.skipped == (i == 2)  # GradScaler's own found_inf.item()
            opt.zero_grad(set_to_none=True)
    # Monitor.step with a scaler: GradScaler's sync only on applied steps (on a skip the monitor already knows)
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt, torch.amp.GradScaler("cpu", init_scale=256.0), every=every, inject_inf_at=1) as mon:
        for i in range(3):
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            sync_counter.clear()
            r = mon.step(loss)
            assert sum(sync_counter.values()) == (1 if r.skipped else 2), dict(sync_counter)
            assert r.skipped == (i == 1)
    # Monitor.step without a scaler: one in all (SGD makes none)
    model, x, y = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt, every=every, inject_inf_at=1) as mon:
        for _ in range(3):
            loss = nn.functional.mse_loss(model(x), y)
            sync_counter.clear()
            mon.step(loss)
            assert sum(sync_counter.values()) == 1, dict(sync_counter)


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_demo_runs_as_a_script(tmp_path: Path) -> None:
    import subprocess

    r = subprocess.run([sys.executable, str(SAMPLES / "skip_demo.py"), "--steps", "8", "--log", str(tmp_path / "s.csv")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "SKIP   5" in r.stdout
    assert read_step_log(tmp_path / "s.csv").skipped[5]


def test_note_clip_logs_the_loops_own_pre_clip_norm_and_the_norm_after_its_clip() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, quiet=True)
    loss = model(torch.full((3, 4), 30.0)).pow(2).mean()
    loss.backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    mon.note_clip(total)
    mon.after_backward(loss)
    opt.step()
    r = mon.after_step()
    assert r.grad_l2_pre_clip == float(total) > 0.5 and r.grad_l2_post_clip == pytest.approx(0.5, rel=1e-5)
    opt.zero_grad()
    loss = model(torch.ones(3, 4)).pow(2).mean()  # no note this step: both are the norm after_backward sees
    loss.backward()
    mon.after_backward(loss)
    r = mon.after_step()
    assert r.grad_l2_pre_clip == r.grad_l2_post_clip
    with pytest.raises(UsageError, match="one total norm"):
        mon.note_clip(torch.ones(3))
    mon.close()


def test_every_keyword_argument_is_a_validated_config_field() -> None:
    """``Monitor(...)``'s keyword arguments and ``MonitorConfig``'s fields are one list, with one default each; the
    config is frozen and refuses misuse with the words the Monitor gives."""
    import dataclasses
    import inspect

    from ampdoctor.engine.monitor import MonitorConfig

    kw = {n: p.default for n, p in inspect.signature(Monitor.__init__).parameters.items()
          if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {f.name: f.default for f in dataclasses.fields(MonitorConfig)}
    assert list(kw) == list(fields)
    assert {n: d for n, d in kw.items() if n not in ("inject_inf_at", "inject_spike_at")} == {
        n: d for n, d in fields.items() if n not in ("inject_inf_at", "inject_spike_at")}
    model = nn.Linear(2, 2)
    mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), window=7, inject_inf_at=[3, 5], ring=0)
    assert mon.config.window == 7 and mon.config.inject_inf_at == frozenset({3, 5}) and mon.inject_inf_at == {3, 5}
    with pytest.raises(dataclasses.FrozenInstanceError):
        mon.config.window = 8  # type: ignore[misc]
    mon.close()
    for bad, said in ((dict(window=0), "window must be at least 1, got 0"),
                      (dict(spike_sigmas=3.0, ring=0), "spike_sigmas needs the lookback ring"),
                      (dict(mode="fast"), "mode must be 'full' or 'sentinel', got 'fast'")):
        with pytest.raises(UsageError, match=said):
            MonitorConfig(**bad)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match=said):
            Monitor(model, None, **bad)  # type: ignore[arg-type]
