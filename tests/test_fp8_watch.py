"""The Monitor's FP8 part on a torchao-converted model: per-GEMM statistics logged each step, the history, the
alerts and the forecast; the run is bit-identical with and without it."""

from __future__ import annotations

import copy
import csv
import dataclasses

import pytest
import torch
from torch import nn

from ampdoctor.engine.fp8_watch import Fp8Watch, log_path_for

pytest.importorskip("torchao")
pytestmark = pytest.mark.fp8

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402


def _converted(recipe: str = "tensorwise") -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return convert_to_float8_training(m, config=cfg)


def _train(model: nn.Module, steps: int, watch: Fp8Watch | None, shrink: float = 1.0) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    alerts = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=g) * shrink**step
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if watch is not None:
            alerts.extend(watch.end(step))
    _train.alerts = alerts  # type: ignore[attr-defined]
    return [p.detach().clone() for p in model.parameters()]


def test_logs_every_gemm_each_step_and_changes_nothing(tmp_path) -> None:
    a, b = _converted(), None
    b = copy.deepcopy(a)
    log = log_path_for(tmp_path / "steps.csv")
    w = Fp8Watch.attach(a, log)
    assert w is not None and Fp8Watch.attach(nn.Linear(2, 2)) is None
    with_watch = _train(a, 5, w)
    w.close()
    without = _train(b, 5, None)
    assert all(torch.equal(p, q) for p, q in zip(with_watch, without, strict=True))
    rows = list(csv.DictReader(log.open()))
    assert len(rows) == 5 * 2 * 3  # 5 steps x 2 Linears x (input, weight, output gradient)
    assert {r["operand"] for r in rows} == {"input", "weight", "grad_output"}
    assert [h[0] for h in w.history("0", "input")] == [0, 1, 2, 3, 4]
    assert float(rows[0]["scale"]) == pytest.approx(448.0 / float(rows[0]["amax"]), rel=1e-6)


def test_forecast_an_amax_heading_to_the_floor() -> None:
    """Inputs shrinking 8x a step: the first Linear's input amax falls 3 binades a step, from ~4 to 1e-12's
    2^-40 in about 14 steps: the forecast says so once, before the scale degenerates."""
    model = _converted()
    w = Fp8Watch.attach(model, horizon=1000)
    _train(model, 10, w, shrink=1 / 8)
    alerts = [a for a in _train.alerts if a.kind == "forecast" and a.module == "0" and a.operand == "input"]  # type: ignore[attr-defined]
    assert len(alerts) == 1 and alerts[0].step == 7 and 0 < alerts[0].value < 30


def test_no_forecast_for_a_steady_run() -> None:
    model = _converted()
    w = Fp8Watch.attach(model)
    _train(model, 12, w)
    assert not [a for a in _train.alerts if a.kind == "forecast"]  # type: ignore[attr-defined]


def _monitored(model: nn.Module, steps: int, log, zero_b: bool = False) -> list[torch.Tensor]:
    import ampdoctor

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    mon = ampdoctor.Monitor(model, opt, log=log) if log is not None else None
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        if mon is not None:
            mon.after_backward()
        opt.step()
        if mon is not None:
            mon.after_step()
        opt.zero_grad()
    if mon is not None:
        mon.close()
    return [p.detach().clone() for p in model.parameters()]


def test_monitor_logs_per_gemm_statistics_and_changes_nothing(tmp_path) -> None:
    a = _converted()
    b = copy.deepcopy(a)
    log = tmp_path / "steps.csv"
    watched = _monitored(a, 4, log)
    plain = _monitored(b, 4, None)
    assert all(torch.equal(p, q) for p, q in zip(watched, plain, strict=True))
    rows = list(csv.DictReader((tmp_path / "steps.fp8.csv").open()))
    assert [int(r["step"]) for r in rows[::6]] == [0, 1, 2, 3]  # 2 Linears x 3 operands a step
    assert {(r["module"], r["operand"]) for r in rows} == {(m, o) for m in ("0", "2") for o in ("input", "weight", "grad_output")}


def test_monitor_says_a_degenerate_scale_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Linear whose weight is all zero, cast with no amax floor (ao#3356's arithmetic): one Fp8Warning naming it."""
    from torchao.float8 import float8_utils

    from ampdoctor.engine.monitor.fp8 import Fp8Warning

    monkeypatch.setattr(float8_utils, "EPS", 0.0)
    model = _converted()
    with torch.no_grad():
        model[2].weight.zero_()
    with pytest.warns(Fp8Warning) as got:
        _monitored(model, 3, tmp_path / "steps.csv")
    said = [str(w.message) for w in got if issubclass(w.category, Fp8Warning)]
    assert len([m for m in said if "the weight of 2" in m and "degenerate scale" in m]) == 1, said


def test_capture_of_an_fp8_failure_replays_to_its_verdict(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Monitor captures the failing step of a converted model (the recipe in the manifest); ``triage --from
    --target fp8`` replays it from the captured weights and batch: the cause, Linear, operand and the run's step."""
    import importlib.util
    import json

    from torchao.float8 import float8_utils
    from typer.testing import CliRunner

    import ampdoctor
    from ampdoctor.cli.app import app
    from ampdoctor.ladder.fp8 import Float8Transform

    from .conftest import SAMPLES

    monkeypatch.setattr(float8_utils, "EPS", 0.0)  # what the sample does on import (no amax floor: ao#3356)
    spec = importlib.util.spec_from_file_location("fp8_degenerate_scale", SAMPLES / "fp8_degenerate_scale.py")
    s = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(s)  # type: ignore[union-attr]
    torch.manual_seed(0)
    model = Float8Transform("rowwise").apply(s.build_model(), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cap = tmp_path / "cap"
    mon = ampdoctor.Monitor(model, opt, capture=cap, first_step=500, quiet=True)
    for x, y in s.build_dataloader()[:2]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = s.loss_fn(model(x).float(), y)
        mon.step(loss, batch=(x, y))
    mon.close()
    manifest = json.loads((cap / "manifest.json").read_text())
    assert manifest["step"] == 500 and manifest["fp8"]["casts"]["input"] == "fp8_e4m3/rowwise"
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / "fp8_degenerate_scale.py"), "--from", str(cap), "--target", "fp8",
                                   "--json", "-"])
    assert res.exit_code == 1, res.output
    rep = json.loads(res.stdout)
    assert (rep["cause"], rep["module"], rep["operand"], rep["step"], rep["recipe"]) == (
        "fp8_degenerate_scale", "0.lora_b", "weight", 500, "rowwise")
