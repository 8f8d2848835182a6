"""The lookback ring, its forecast, its spike trigger and the story a capture's report tells from it."""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor.capture.schema import read_ring
from ampdoctor.engine.monitor import Monitor
from ampdoctor.engine.ring import ForecastWarning
from ampdoctor.errors import UsageError
from ampdoctor.judge.history import forecast, mann_kendall_z, story, theil_sen
from ampdoctor.watch.ring import LAYER_COLUMNS, STEP_COLUMNS

from .conftest import SAMPLES
from .ring_models import HEALTHY, train

FP16_MAX = 65504.0


def _sample(name: str):  # noqa: ANN202
    sys.path.insert(0, str(SAMPLES))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(SAMPLES))


# -- the ring itself -------------------------------------------------------------------------------------
def test_the_ring_keeps_the_last_k_steps_with_the_layers_figures_from_the_one_host_copy() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, None, ring=8, quiet=True)
    mon.recipe.ring_figures.every = 1  # (the optimizer's figures on every recorded step, as with spike_sigmas)
    seen: dict[int, float] = {}
    for s in range(20):
        x = torch.randn(6, 4)
        loss = model(x).pow(2).mean()
        loss.backward()
        seen[s] = float(torch.sqrt(model[2].weight.grad.pow(2).sum() + model[2].bias.grad.pow(2).sum()))
        mon.after_backward(loss)
        opt.step()
        mon.after_step()
        opt.zero_grad(set_to_none=True)
    ring = mon.lookback.ring
    assert ring.count == 20 and ring.capacity == 8
    steps, text = ring.tables()
    rows = steps.strip().splitlines()
    assert rows[0].split(",") == ["step", *STEP_COLUMNS]
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(12, 20))
    st, gn = ring.layer_series("grad_norm")
    m = ring.names.index("2")
    assert list(st) == list(range(12, 20))
    assert np.allclose(gn[:, m], [seen[s] for s in range(12, 20)], rtol=1e-5)
    _, ab = ring.layer_series("absmax")
    _, hd = ring.layer_series("headroom")
    assert np.allclose(hd[:, m], np.log2(FP16_MAX / ab[:, m]), atol=1e-5)
    # SGD without momentum: the update is lr x the gradient
    _, un = ring.layer_series("update_norm")
    assert np.allclose(un[:, m], 0.1 * gn[:, m], rtol=1e-5)
    # fixed buffers: step numbers, scalars, and layers x figures
    assert ring.memory_bytes == 8 * 8 + 8 * len(STEP_COLUMNS) * 8 + 8 * len(ring.names) * len(LAYER_COLUMNS) * 4
    mon.close()


def test_adams_figures_are_read_from_its_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, None, ring=4, quiet=True)
    mon.recipe.ring_figures.every = 1  # (the optimizer's figures on every recorded step, as with spike_sigmas)
    for _ in range(3):
        loss = model(torch.randn(5, 4)).pow(2).mean()
        loss.backward()
        if opt.state:
            w = model[0].weight
            stw, stb = opt.state[w], opt.state[model[0].bias]
            k = float(stw["step"])
            f = 0.01 * math.sqrt(1 - 0.999**k) / (1 - 0.9**k)
            want = f * math.sqrt(float((stw["exp_avg"] / (stw["exp_avg_sq"].sqrt() + 1e-8)).pow(2).sum()
                                       + (stb["exp_avg"] / (stb["exp_avg_sq"].sqrt() + 1e-8)).pow(2).sum()))
            vmin = min(float(stw["exp_avg_sq"].min()), float(stb["exp_avg_sq"].min()))
        mon.after_backward(loss)
        opt.step()
        mon.after_step()
        opt.zero_grad(set_to_none=True)
    _, un = mon.lookback.ring.layer_series("update_norm")
    _, vm = mon.lookback.ring.layer_series("exp_avg_sq_min")
    m = mon.lookback.ring.names.index("0")
    assert math.isnan(un[0, m])  # no state before the first step
    assert un[-1, m] == pytest.approx(want, rel=1e-5)
    assert vm[-1, m] == pytest.approx(vmin, rel=1e-5)
    mon.close()


@pytest.mark.parametrize("kw", [{"ring": -1}, {"ring": 2.5}, {"forecast_horizon": 0}, {"spike_sigmas": 0},
                                {"spike_sigmas": 3, "ring": 0}, {"spike_sigmas": 3, "spike_window": 8},
                                {"spike_sigmas": 3, "ring": 50}])
def test_ring_arguments_are_checked_at_once(kw: dict) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(UsageError):
        Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), None, **kw)


def test_ring_zero_keeps_nothing_and_forecasts_nothing() -> None:
    model = nn.Linear(2, 2)
    mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), None, ring=0, quiet=True)
    mon.step(model(torch.randn(3, 2)).sum())
    assert mon.lookback is None and mon.forecast() == []
    mon.close()


# -- the forecast rule, on numbers ----------------------------------------------------------------------
def _fc(values: np.ndarray, steps: np.ndarray | None = None, horizon: int = 1000):  # noqa: ANN202
    steps = np.arange(len(values)) if steps is None else steps
    a = values.reshape(-1, 1).astype(np.float32)
    return forecast(steps, a, np.zeros_like(a), ["layer"], FP16_MAX, horizon)


def test_theil_sen_and_mann_kendall_on_known_series() -> None:
    x = np.arange(50.0)
    y = 3.0 * x + 7.0
    y[10] = 1e6  # one wild batch moves the median slope nowhere
    assert theil_sen(x, y) == pytest.approx((3.0, 7.0))
    assert mann_kendall_z(np.arange(40.0)) > 8
    assert abs(mann_kendall_z(np.zeros(40))) == 0


def test_a_linear_climb_is_forecast_at_the_step_it_reaches_the_max() -> None:
    t = np.arange(100, 164)
    fc = _fc(300.0 * t + 1000.0, t)  # reaches 65504 at step 215.01
    assert len(fc) == 1 and fc[0].layer == "layer"
    assert fc[0].latest_step == 216 and fc[0].expected_step == 216
    assert fc[0].headroom == pytest.approx(math.log2(FP16_MAX / (300.0 * 163 + 1000.0)), rel=1e-3)


def test_a_quadratic_climb_is_forecast_near_its_crossing() -> None:
    t = np.arange(40, 104)
    fc = _fc(65504.0 * (t / 154.0) ** 2, t)
    assert len(fc) == 1
    assert abs(fc[0].expected_step - 154) <= 5
    assert fc[0].latest_step > fc[0].expected_step


@pytest.mark.parametrize("name", ["flat_noise", "warmup_transient", "slow_linear", "too_few", "heavy_tail"])
def test_the_forecast_stays_silent_on_healthy_shapes(name: str) -> None:
    rng = np.random.default_rng(0)
    t = np.arange(64)
    series = {
        "flat_noise": 20.0 + rng.normal(0, 5, 64),
        "warmup_transient": 0.5 + 10 * (1 - np.exp(-t / 20.0)),  # a fast rise that flattens: 10, not 65504
        "slow_linear": 100.0 + 10.0 * t,  # 6,000 steps from the max
        "too_few": 1000.0 * np.arange(20),
        "heavy_tail": 50.0 * np.exp(rng.standard_t(2, 64) * 0.5),
    }[name]
    assert _fc(series) == []


# -- the samples ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def late_overflow_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Monitor, list[warnings.WarningMessage], Path]:
    lo = _sample("late_overflow")
    cap = tmp_path_factory.mktemp("lo") / "cap"
    model = lo.build_model()
    opt = lo.build_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    data = lo.build_dataloader()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Monitor(model, opt, scaler, capture=cap, snapshot_every=100) as mon:
            for step in range(156):
                x, y = data[step % len(data)]
                with mon.autocast():
                    loss = lo.loss_fn(model(x), y)
                mon.step(loss, batch=(x, y))
    return mon, list(seen), cap


def test_late_overflow_forecasts_logits_at_least_30_steps_before_step_154(late_overflow_run) -> None:  # noqa: ANN001
    mon, seen, _ = late_overflow_run
    assert mon.first_failure == (154, "nonfinite_loss")  # the ring changed nothing of the run
    fcw = [w for w in seen if issubclass(w.category, ForecastWarning)]
    assert len(fcw) == 1  # once
    fc = mon.lookback.warned
    assert fc is not None and fc.layer == "logits"
    assert fc.step <= 154 - 30
    said = str(fcw[0].message)
    assert "logits" in said and f"step {fc.step}:" in said and "Keep logits in FP32" in said  # with triage's fixes
    assert fc.expected_step < fc.latest_step  # the growth accelerates (q and k both grow)
    assert 0 < fc.headroom < 8


def test_late_overflow_capture_holds_the_ring_and_its_story_shows_the_headroom_reaching_zero(late_overflow_run) -> None:  # noqa: ANN001
    _, _, cap = late_overflow_run
    manifest = json.loads((cap / "manifest.json").read_text())
    assert {"ring_steps.csv", "ring_layers.csv"} <= set(manifest["files"])
    assert manifest["ring"] == {"steps": 256, "kept": 155}
    steps, layers = read_ring(cap, manifest["files"])
    assert list(steps["step"]) == list(range(155))
    told = story(steps, layers, 154, "logits")
    assert told is not None and told["layer"] == "logits"
    assert told["crossed_step"] == 154
    assert told["headroom_last"] == 0.0 and told["headroom_first"] > 12
    hs = told["headroom"]["binades"]
    assert hs[0] > 12 and min(hs[:-1]) > 0 and hs[-1] == 0  # it fell to 0 over the steps before the failure
    assert told["movers"][0]["layer"] == "logits"  # the product moved first, then the projections


def test_the_report_of_the_capture_tells_the_story_in_every_format(late_overflow_run, tmp_path: Path) -> None:  # noqa: ANN001
    from ampdoctor.engine.triage import triage
    from ampdoctor.input.config import TriageConfig
    from ampdoctor.render import html, markdown, terminal
    from ampdoctor.render.plots import figures

    _, _, cap = late_overflow_run
    report, _ = triage(SAMPLES / "late_overflow.py", TriageConfig(), from_capture=cap)
    assert report.verdict.cause == "fp16_forward_overflow" and report.verdict.first_module == "logits"
    told = [f for f in report.findings if f.code == "history"]
    assert len(told) == 1
    f = told[0]
    assert f.module == "logits" and f.step == 154
    assert "reached 0 at step 154" in f.title
    d = report.to_dict()
    ev = next(x for x in d["findings"] if x["code"] == "history")["evidence"]
    assert ev["crossed_step"] == 154 and len(ev["series"]["loss"]) == 155 and ev["series"]["step"][-1] == 154
    assert "history" in figures(report) and "loss" not in figures(report)  # the run's history, not 1 replayed point
    md = markdown.render(report, {"history": "r_files/history.png"})
    assert "## Before the failure" in md and "reached 0 at step 154" in md and "r_files/history.png" in md
    page = html.render(report, {})
    assert "Before the failure" in page and "reached 0 at step 154" in page
    import io

    from rich.console import Console

    buf = io.StringIO()
    terminal.render(report, Console(file=buf, width=100))
    text = " ".join(buf.getvalue().split())
    assert "Before the failure" in text and "reached 0 at step 154" in text and "moved first: logits" in text


@pytest.mark.slow
def test_a_linear_late_growth_is_forecast_by_name_and_step() -> None:
    lg = _sample("late_growth")
    bad, mon = lg.train(200, quiet=True)
    assert bad is not None and 150 <= bad <= 190
    fc = mon.lookback.warned
    assert fc is not None and fc.layer == "head" and fc.step <= bad - 30
    assert abs(mon.lookback.warned.latest_step - bad) <= 0.5 * (bad - fc.step)  # linear: the straight line is right


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_no_forecast_on_healthy_runs_of_1000_steps(name: str) -> None:
    mon, bad, said = train(HEALTHY[name], 1000, quiet=False)
    assert bad is None
    assert mon.lookback.warned is None and said == []
    assert mon.lookback.ring.count == 1000


# -- the spike trigger ------------------------------------------------------------------------------------
def _spiky(steps: int, lr_jump_at: int | None, cap: Path | None, **kw: object) -> Monitor:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=g)
    data = [(x, x @ w) for x in (torch.randn(32, 8, generator=g) for _ in range(16))]
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=10**6)  # no overflow: a spike, not a NaN
    mon = Monitor(model, opt, scaler, capture=cap, quiet=True, alert_min_steps=10**9, **kw)  # type: ignore[arg-type]
    for s in range(steps):
        if s == lr_jump_at:
            for gr in opt.param_groups:
                gr["lr"] = 0.1  # a learning rate 100x too high from here: the updates jump first, the loss after
        x, y = data[s % len(data)]
        with mon.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        mon.step(loss, batch=(x, y))
    mon.close()
    return mon


def test_the_spike_trigger_is_off_by_default_and_silent_on_a_steady_run(tmp_path: Path) -> None:
    mon = _spiky(200, 150, tmp_path / "off")
    assert mon.first_failure is None and mon.lookback.last_spike is None and not (tmp_path / "off").exists()
    mon = _spiky(200, None, tmp_path / "steady", spike_sigmas=6.0)
    assert mon.first_failure is None and not (tmp_path / "steady").exists()


def test_a_loss_spike_is_captured_and_names_the_layers_whose_updates_spiked_first(tmp_path: Path) -> None:
    mon = _spiky(200, 150, tmp_path / "cap", spike_sigmas=6.0)
    assert mon.first_failure is not None
    step, reason = mon.first_failure
    assert reason in ("loss_spike", "grad_norm_spike") and 151 <= step <= 165
    sp = mon.lookback.last_spike
    assert sp is not None and sp.step == step and sp.z > 6
    assert sp.layers and sp.layers[0]["figure"] == "update_norm"
    assert sp.layers[0]["step"] == 150 and sp.layers[0]["step"] <= step  # the updates jumped at the lr change
    manifest = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert manifest["reason"] == reason and manifest["step"] == step
    assert manifest["spike"]["layers"][0]["layer"] == sp.layers[0]["layer"]


# -- the deferred fill: a run of steps computed together gives each step's own figures ------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

from ampdoctor.formats import FP16  # noqa: E402
from ampdoctor.records import NCOLS, Col  # noqa: E402
from ampdoctor.watch.ring import Ring, _Pending  # noqa: E402

_SPECIAL = [0.0, 1.0, 3.0, 65504.0, 7e4, 1e-8, np.inf, np.nan]


def _rows(rng: np.random.Generator, k: int) -> np.ndarray:
    r = np.abs(rng.standard_normal((k, NCOLS))) * rng.choice([1.0, 100.0, 1e5], size=(k, NCOLS))
    r[:, Col.NUMEL] = rng.integers(0, 5000, size=k)
    for c in (Col.POSINF, Col.NEGINF, Col.NAN, Col.OVERFLOW, Col.UNDERFLOW):
        r[:, c] = np.where(rng.random(k) < 0.2, rng.integers(0, 50, size=k), 0)
    r[:, Col.ABSMAX] = np.where(rng.random(k) < 0.3, rng.choice(_SPECIAL, size=k), r[:, Col.ABSMAX])
    return r


def _params_one_by_one(ring: Ring, slot: int, tail: Any, params: list[str]) -> None:
    """The parameter figures as the definition has them, a layer at a time in plain Python: the L2 norm over the
    layer's parameters' figures (squares summed in order, in double), the smallest exp_avg_sq (NaN if one is)."""
    from ampdoctor.watch.ring import module_of

    (grad_j, upd_j, vmin_j, factor), vals = tail
    owner = [module_of(n, {m: i for i, m in enumerate(ring.names)}) for n in params]
    fac = np.broadcast_to(np.asarray(factor, dtype=np.float64), (len(upd_j),))
    k = 0
    for col, js, mult in (("grad_norm", grad_j, None), ("update_norm", upd_j, fac)):
        sums: dict[int, float] = {}
        for q, j in enumerate(js):
            v = float(vals[k + q]) * (float(mult[q]) if mult is not None else 1.0)
            m = owner[j] if j >= 0 else None
            if m is not None:
                sums[m] = sums.get(m, 0.0) + v * v
        for m, sq in sums.items():
            ring.layers[slot, m, LAYER_COLUMNS.index(col)] = math.sqrt(sq)
        k += len(js)
    lows: dict[int, float] = {}
    for q, j in enumerate(vmin_j):
        v = float(vals[k + q])
        m = owner[j] if j >= 0 else None
        if m is not None:
            lo = lows.get(m, math.inf)
            lows[m] = math.nan if math.isnan(v) or math.isnan(lo) else min(lo, v)
    for m, lo in lows.items():
        if math.isfinite(lo):
            ring.layers[slot, m, LAYER_COLUMNS.index("exp_avg_sq_min")] = lo


@settings(max_examples=60, deadline=None)
@given(seed=hst.integers(0, 2**32 - 1), steps=hst.integers(2, 16), unique=hst.booleans())
def test_the_layer_figures_of_steps_filled_together_are_those_of_each_step_alone(seed: int, steps: int,
                                                                                unique: bool) -> None:
    rng = np.random.default_rng(seed)
    names = ["model", "a", "a.b", "c", "d", "e"]
    params = ["a.weight", "a.b.weight", "a.b.bias", "c.weight", "e.weight", "orphan"]
    k = int(rng.integers(1, 6))
    mi = rng.permutation(len(names))[:k] if unique else rng.integers(0, len(names), size=k)
    grad_j = rng.integers(-1, len(params), size=int(rng.integers(0, 8)))
    upd_j = rng.integers(-1, len(params), size=int(rng.integers(0, 8)))
    vmin_j = rng.integers(-1, len(params), size=int(rng.integers(0, 8)))
    nv = len(grad_j) + len(upd_j) + len(vmin_j)
    together, alone = Ring(32, names, FP16), Ring(32, names, FP16)
    for ring in (together, alone):
        ring.set_params(params)
        ring.layers[:] = np.nan
    run = []
    per_figure = bool(rng.random() < 0.5)  # the update factor: one a figure, or one number
    for s in range(steps):
        vals = rng.standard_normal(nv) * rng.choice([1.0, 1e3, 1e20], size=nv)
        vals = np.where(rng.random(nv) < 0.15, rng.choice(_SPECIAL, size=nv), vals)
        factor = rng.random(len(upd_j)) if per_figure else np.float64(rng.random())
        tail = ((grad_j, upd_j, vmin_j, factor), vals)
        outs = (_rows(rng, k), mi, _rows(rng, int(rng.integers(0, 3))))
        extra = int(rng.integers(0, 3))  # (rows of other tensors in the step's matrix, in a shuffled order)
        matrix = np.concatenate([outs[0], outs[2], _rows(rng, extra)])
        order = rng.permutation(len(matrix))
        where = np.argsort(order)
        run.append(_Pending(s, (matrix[order], where[:k], mi, where[k: k + len(outs[2])]), tail))
        with np.errstate(all="ignore"):
            alone._fill_outputs(s, outs[0], mi)
        _params_one_by_one(alone, s, tail, params)
        if len(outs[2]):
            alone.scalars[s, STEP_COLUMNS.index("input_numel")] = float(outs[2][:, Col.NUMEL].sum())
            alone.scalars[s, STEP_COLUMNS.index("input_absmax")] = float(outs[2][:, Col.ABSMAX].max())
    with np.errstate(all="ignore"):
        together._fill_run(run)
    assert np.array_equal(together.layers, alone.layers, equal_nan=True)
    assert np.array_equal(together.scalars, alone.scalars, equal_nan=True)


def test_a_read_computes_the_steps_waiting_and_a_small_ring_never_overwrites_one() -> None:
    for cap in (1, 3, 40):
        model, batch, loss_fn, make_opt, _ = HEALTHY["cnn"]()
        mon = Monitor(model, make_opt(model.parameters()), None, ring=cap, quiet=True, forecast_horizon=None)
        for s in range(5):
            x, y = batch(s)
            mon.step(loss_fn(model(x), y))
        ring = mon.lookback.ring
        assert len(ring._pending) < min(16, cap) or cap == 1 and not ring._pending
        steps, absmax = ring.layer_series("absmax")
        assert not ring._pending and len(steps) == min(5, cap)
        assert (np.isfinite(absmax).sum(axis=1) >= 3).all()  # (each step: its layers' figures)
        mon.close()
