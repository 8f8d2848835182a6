"""Issue 45: a skip is judged by what the gradients did, not by counting skips (docs/diagnosis.md, "Which skip is a
failure"). Properties on scale histories made by GradScaler's own arithmetic, then real runs with ``GradScaler()``
untouched: early back-offs do not take the capture, a NaN batch later is captured at its step, a persistent overflow
is reported at its first skip and replays from it, a capture of normal work is triaged healthy, and skipping that
goes on after the first failure is said once."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ampdoctor import Monitor
from ampdoctor.capture.trigger import JUMP_RATIO, FailingStep, Trigger

F = 65504.0


def scaler_run(grads: list[float], init: float = 2.0**16, interval: int = 2000) -> list[tuple[float, bool, Trigger | None]]:
    """GradScaler's arithmetic over the largest unscaled gradient of each step: step t skips iff s * G_t > F (FP16's
    max), the scale halves on a skip and doubles after ``interval`` clean steps; each step judged by ``FailingStep``
    with the applied steps' G. Returns (scale used, skipped, trigger) per step."""
    rule, s, clean, out = FailingStep(growth_interval=interval), init, 0, []
    for t, g in enumerate(grads):
        skip = not math.isfinite(s * g) or s * g > F
        trig = rule.judge(skipped=skip, reason="nonfinite_grad:m" if skip else "", scale=s, alert=False,
                          nonfinite=skip, step=t, grad_max=None if skip else g)
        out.append((s, skip, trig))
        if skip:
            s, clean = s * 0.5, 0
        else:
            clean += 1
            if clean == interval:
                s, clean = s * 2.0, 0
    return out


def _smooth(start: float, factors: list[float], top: float) -> list[float]:
    g, out = start, []
    for f in factors:
        g = min(g * f, top)
        out.append(g)
    return out


@settings(max_examples=150, deadline=None)
@given(st.floats(1e-6, 1e3), st.lists(st.floats(1 / 1.5, 1.5), min_size=5, max_size=300),
       st.sampled_from([2.0**16, 2.0**10, 2.0**24, 4.0]), st.sampled_from([2000, 50, 7]))
def test_gradients_that_grow_smoothly_within_fp16_never_fail_however_often_the_scale_backs_off(
        g0: float, factors: list[float], init: float, interval: int) -> None:
    # G_t <= F/2 and G_t / G_{t-1} in [1/1.5, 1.5]: a skip at s needs s > F/G_t >= 2, and a run of k skips after the
    # applied step a needs at most 1.5^k growth while the scale falls 2^k: it ends within 2 skips, need < 1000
    grads = _smooth(g0, factors, F / 2)
    run = scaler_run(grads, init, interval)
    assert [t for _, _, t in run if t is not None] == []


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-4, 10.0), st.integers(8, 40), st.floats(1.0, 1e6), st.integers(1, 30))
def test_a_jump_is_judged_exactly_by_the_growth_the_skips_need(g0: float, at: int, ratio: float, hold: int) -> None:
    # steady gradients g0, then from step `at` the gradient holds `ratio` x higher for `hold` steps. With s the
    # scale at `at`, the k-th skip of that run comes at s / 2^(k-1) and needs need_1 * 2^(k-1) growth,
    # need_1 = F / (s * g0): it happens while that is below `ratio`, and it is the failure once that reaches
    # JUMP_RATIO or the scale is <= 1. Exactly then, and said at step `at`
    grads = [g0] * at + [g0 * ratio] * hold + [g0] * 5
    run = scaler_run(grads)
    assert not run[at - 1][1]  # applied just before the jump (GradScaler() calibrates g0 within 4 steps)
    s_at, need1 = run[at][0], F / (run[at][0] * g0)
    expect = None
    for k in range(1, hold + 1):
        need, s = need1 * 2.0 ** (k - 1), s_at / 2.0 ** (k - 1)
        if not need < ratio:
            break  # the k-th step fits at s: applied, the run is over
        if need >= JUMP_RATIO or s <= 1.0:
            expect = at + k - 1
            break
    trigs = [(t, trig) for t, (_, _, trig) in enumerate(run) if trig is not None]
    if expect is None:
        assert trigs == []
    else:
        t, trig = trigs[0]
        assert t == expect and (trig.first if trig.first is not None else t) == at
        assert trig.why == ("jump" if need >= JUMP_RATIO else "unscaled")


@settings(max_examples=100, deadline=None)
@given(st.floats(1e-3, 1e3), st.integers(3, 60), st.floats(1.01, 100.0))
def test_an_overflow_of_the_unscaled_gradients_is_reported_at_its_first_skip(g0: float, at: int, over: float) -> None:
    # from step `at` the unscaled gradient itself leaves FP16 (G > F) and stays: GradScaler skips until its scale
    # falls below F/G <= 1, so a skip at a scale <= 1 (or a jump) judges it, at the first skip of the run
    grads = [g0] * at + [F * over] * 40
    run = scaler_run(grads)
    trigs = [(t, trig) for t, (_, _, trig) in enumerate(run) if trig is not None]
    assert trigs, run[at:]
    t, trig = trigs[0]
    # the first skip since the last applied step (calibration may still run into `at`: nothing applied since)
    run_start = max([u + 1 for u in range(at) if not run[u][1]], default=0)
    assert (trig.first if trig.first is not None else t) == run_start and trig.why in ("unscaled", "jump")


def test_calibration_from_the_default_scale_and_a_gradient_that_needs_a_scale_below_one() -> None:
    # gradients at 3e4: GradScaler() halves from 2^16 to 2 (15 skips, calibration), never a failure
    run = scaler_run([3e4] * 40)
    assert sum(s for _, s, _ in run) == 15 and all(t is None for *_, t in run)
    # gradients at 1e5 > F from step 0: the calibration reaches 1 and still overflows: a failure at step 0
    run = scaler_run([1e5] * 40)
    trig = next(t for *_, t in run if t is not None)
    assert (trig.first, trig.why) == (0, "unscaled")


# real runs, GradScaler() untouched ------------------------------------------------------------------------------

def _growing(tmp: Path, nan_at: int | None, steps: int = 60, **kw: object) -> tuple[Monitor, list]:
    """A plain loop whose gradients grow over the first 20 steps (targets grow 1.12x a step: the scale backs off
    several times, as it does in the first steps of real training), a NaN in the batch of ``nan_at``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    recs = []
    with Monitor(model, opt, torch.amp.GradScaler("cpu"), quiet=True, **kw) as mon:  # type: ignore[arg-type]
        for step in range(steps):
            x = torch.randn(32, 16, generator=g)
            y = torch.randn(32, 1, generator=g) * (1.12 ** min(step, 20))
            if step == nan_at:
                x[3, 5] = float("nan")
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x), y, reduction="sum")
            recs.append(mon.step(loss, batch=(x, y)))
    return mon, recs


def test_plain_loop_defaults_back_offs_do_not_take_the_capture_and_the_nan_batch_is_captured(tmp_path: Path) -> None:
    mon, recs = _growing(tmp_path, 40, steps=41, capture=tmp_path / "cap")
    backoffs = [r.step for r in recs if r.skipped and r.step < 40 and r.step > 0 and r.scaler_scale < 2.0**16]
    established = [r.step for r in recs if r.skipped and any(not q.skipped and q.step < r.step for q in recs)]
    assert len([s for s in established if s < 40]) >= 2, backoffs  # two or more ordinary back-offs before step 40
    assert mon.first_failure == (40, "nonfinite_loss")
    assert [r.step for r in recs if r.capture] == [40]
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["step"], m["reason"]) == (40, "nonfinite_loss")


PERSIST_SPEC = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))

def build_dataloader():
    return [(torch.rand(2000, 8), torch.full((2000, 1), 4.0))]

def loss_fn(out, y):
    return nn.functional.mse_loss(out, y, reduction="sum")  # summed over tokens: the gradients grow with them

def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-12)
'''


def _persistent(folder: Path, steps: int = 40, at: int = 30) -> tuple[Monitor, list]:
    """A summed-token loss: 2000 tokens a step (GradScaler() calibrates down to 4), then 16000 from step ``at``: the
    unscaled gradients leave FP16 (about 2.5 x 65504) and stay there."""
    ns: dict[str, object] = {}
    exec(PERSIST_SPEC, ns)
    model = ns["build_model"]()  # type: ignore[operator]
    opt = ns["build_optimizer"](model.parameters())  # type: ignore[operator]
    g = torch.Generator().manual_seed(1)
    recs = []
    with Monitor(model, opt, torch.amp.GradScaler("cpu"), capture=folder, quiet=True) as mon:
        for step in range(steps):
            n = 2000 if step < at else 16000
            x, y = torch.rand(n, 8, generator=g), torch.full((n, 1), 4.0)
            with mon.autocast():
                loss = ns["loss_fn"](model(x), y)  # type: ignore[operator]
            recs.append(mon.step(loss, batch=(x, y)))
    return mon, recs


@pytest.mark.slow
def test_a_persistent_overflow_is_reported_at_its_first_skip_and_replays_from_it(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ampdoctor.cli.app import app

    mon, recs = _persistent(tmp_path / "cap")
    later = [r.step for r in recs if r.skipped and r.step >= 30]
    assert later[:2] == [30, 31]
    assert mon.first_failure == (30, "nonfinite_grad")  # the first skip, not the second
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert m["first_skip"] == 30 and m["snapshot_step"] == 30 and m["batch_steps"][0] == 30
    assert m["batch_steps"] == list(range(30, m["step"] + 1)) and m["state_step"] is None
    assert m["rng_after_step"] == 29  # the RNG as step 30 began
    snap = torch.load(tmp_path / "cap" / "snapshot.pt", weights_only=True)
    assert snap["scaler"]["scale"] == recs[30].scaler_scale  # GradScaler's state before the first skip
    spec = tmp_path / "spec.py"
    spec.write_text(PERSIST_SPEC)
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    v = rep["verdict"]
    assert (v["cause"], v["first_step"], v["first_module"]) == ("fp16_grad_overflow", 30, "1"), r.stdout[:1500]


def test_a_forced_capture_of_a_default_back_off_is_triaged_healthy(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ampdoctor.cli.app import app

    spec = tmp_path / "spec.py"
    spec.write_text(GROWING_SPEC)
    mon, recs = _growing(tmp_path, None, steps=16, capture=tmp_path / "cap", capture_on="skip")
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert m["scaler_phase"] == "calibration"  # capture_on="skip": the first skip, GradScaler calibrating
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    assert r.exit_code == 0, r.output[-2000:]
    v = json.loads(r.stdout)["verdict"]
    assert (v["cause"], v["first_step"]) == ("healthy", m["step"]), r.stdout[:1500]
    assert "collapsed" not in r.stdout
    assert any(f["code"] == "scaler_normal" for f in json.loads(r.stdout)["findings"])


GROWING_SPEC = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

def build_dataloader():
    return [(torch.randn(32, 16), torch.randn(32, 1))]

def loss_fn(out, y):
    return nn.functional.mse_loss(out, y, reduction="sum")

def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-6)
'''


def test_skipping_that_goes_on_after_the_first_failure_is_said_once(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # a NaN batch at step 5 (the first failure), then from step 30 the unscaled gradients leave FP16: that run of
    # skips is said once, with its steps and how far the scale fell, long before alert_min_steps=100
    ns: dict[str, object] = {}
    exec(PERSIST_SPEC, ns)
    model = ns["build_model"]()  # type: ignore[operator]
    opt = ns["build_optimizer"](model.parameters())  # type: ignore[operator]
    g = torch.Generator().manual_seed(1)
    caplog.set_level(logging.WARNING, logger="ampdoctor")
    with Monitor(model, opt, torch.amp.GradScaler("cpu")) as mon:
        for step in range(40):
            n = 2000 if step < 30 else 16000
            x, y = torch.rand(n, 8, generator=g), torch.full((n, 1), 4.0)
            if step == 20:
                x[0, 0] = float("nan")
            with mon.autocast():
                loss = ns["loss_fn"](model(x), y)  # type: ignore[operator]
            mon.step(loss, batch=(x, y))
    err = caplog.text
    assert mon.first_failure == (20, "nonfinite_loss")  # (its back-off took the scale from 2 to 1)
    lines = [r.getMessage() for r in caplog.records if "in a row" in r.getMessage()]
    assert len(lines) == 1, err  # steps 30 and 31 skipped: one message, at the step that judged it
    assert lines[0] == ("ampdoctor: step 30 skipped (1 in a row); scale 1 -> 0.5, 1 binade(s) down\n"
                        "  the gradients overflow FP16 unscaled, at a scale <= 1")
    assert all(len(ln) <= 80 for ln in lines[0].splitlines())


def test_a_provisional_capture_does_not_spend_the_capture(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # a loss spike (spike_sigmas: a statistic, provisional) at step 30, then a NaN batch at step 45: both captured,
    # the failure beside the first, its folder named for its reason, and one line says which holds the failure
    # (an FP32 loop: with a GradScaler a spike this size overflows and is skipped, and a skip is no spike)
    caplog.set_level(logging.WARNING, logger="ampdoctor")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(2)
    cap = tmp_path / "cap"
    with Monitor(model, opt, capture=cap, spike_sigmas=8.0) as mon:
        for step in range(50):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if step == 30:
                y = y * 50.0  # a finite spike of the loss
            if step == 45:
                x[1, 1] = float("nan")
            mon.step(nn.functional.mse_loss(model(x), y), batch=(x, y))
    first = json.loads((cap / "manifest.json").read_text())
    assert (first["step"], first["reason"]) == (30, "loss_spike")
    second = tmp_path / "cap-2-nonfinite_loss"
    m = json.loads((second / "manifest.json").read_text())
    assert (m["step"], m["reason"]) == (45, "nonfinite_loss")
    held = [r.getMessage() for r in caplog.records if "holds the failure" in r.getMessage()]
    assert held == [f"ampdoctor: {second} holds the failure ({cap} holds the earlier loss_spike of step 30)"]


def test_a_forced_capture_of_a_back_off_at_an_established_scale_is_triaged_healthy(tmp_path: Path) -> None:
    # issue 45's benign capture: a back-off after applied steps at that scale (the Monitor attached after the
    # calibration, capture_on="skip" takes the first skip it sees): scaler_normal, never "collapsed"
    from typer.testing import CliRunner

    from ampdoctor.cli.app import app

    spec = tmp_path / "spec.py"
    spec.write_text(GROWING_SPEC)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    mon = None
    for step in range(20):
        if step == 8:  # past GradScaler's calibration from 2^16 (and its back-off at step 6)
            mon = Monitor(model, opt, sc, capture=tmp_path / "cap", capture_on="skip", first_step=8, quiet=True)
        x = torch.randn(32, 16, generator=g)
        y = torch.randn(32, 1, generator=g) * (1.12 ** min(step, 20))
        if mon is None:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y, reduction="sum")
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
        else:
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x), y, reduction="sum")
            mon.step(loss, batch=(x, y))
    assert mon is not None
    mon.close()
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert m["scaler_phase"] == "backoff" and m["step"] > 8
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    assert r.exit_code == 0, r.output[-2000:]
    rep = json.loads(r.stdout)
    v = rep["verdict"]
    assert (v["cause"], v["first_step"]) == ("healthy", m["step"]), r.stdout[:1500]
    assert "collapsed" not in r.stdout
    normal = [f for f in rep["findings"] if f["code"] == "scaler_normal"]
    assert normal and normal[0]["evidence"]["phase"] == "backoff"


def test_skipping_that_keeps_failing_after_the_capture_is_told_at_the_1st_2nd_4th_run(
        caplog: pytest.LogCaptureFixture) -> None:
    # GradScaler() untouched; NaN losses at step 5 (the first failure), then runs of them at 10, 12, 20, 25, 30-31, 40:
    # six later runs, told at the 1st, 2nd and 4th, from the 2nd on with the tally since step 5's failure
    caplog.set_level(logging.WARNING, logger="ampdoctor")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    bad = {5, 10, 12, 20, 25, 30, 31, 40}
    with Monitor(model, opt, torch.amp.GradScaler("cpu")) as mon:
        for step in range(45):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if step in bad:
                x[0, 0] = float("nan")
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            mon.step(loss, batch=(x, y))
    assert mon.first_failure == (5, "nonfinite_loss")
    lines = [r.getMessage() for r in caplog.records if "in a row" in r.getMessage()]
    assert [ln.splitlines()[0].split(" skipped")[0] for ln in lines] == ["ampdoctor: step 10", "ampdoctor: step 12",
                                                                        "ampdoctor: step 25"], caplog.text
    assert len(lines[0].splitlines()) == 2  # the first: the run and its reason
    assert lines[1].splitlines()[1] == "  2 runs of skips since step 5's failure: 2 step(s) skipped, scale 65536 -> 8192"
    assert lines[2].splitlines()[1].startswith("  4 runs of skips since step 5's failure: 4 step(s) skipped")
