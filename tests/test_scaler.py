"""Scale-history classes on synthetic histories, the skip ledger, and `ampdoctor scaler`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.judge.scaler import infer_backoff, infer_growth_interval, rolling_skip_rate, skip_ledger
from ampdoctor.report.scaler import diagnose_scale
from ampdoctor.watch.steplog import StepLogWriter

runner = CliRunner()


def simulate(steps: int, ceiling: float, init: float = 65536.0, gi: int = 2000, backoff: float = 0.5,
             growth: float = 2.0, spikes: set[int] | None = None) -> tuple[list[float], list[bool]]:
    """GradScaler's own rule, with an overflow whenever the scale exceeds ``ceiling`` (or at a spike step)."""
    scale, tracker = init, 0
    scales, skipped = [], []
    for i in range(steps):
        over = scale > ceiling or (spikes is not None and i in spikes)
        scales.append(scale)
        skipped.append(over)
        if over:
            scale *= backoff
            tracker = 0
        else:
            tracker += 1
            if tracker == gi:
                scale *= growth
                tracker = 0
    return scales, skipped


def test_calibrating() -> None:
    scales, skipped = simulate(50, ceiling=20000.0)
    d = diagnose_scale(scales, skipped)
    assert d.pattern == "calibrating"
    assert d.calibration_skips == 2 and d.later_skips == []
    assert d.settings["init_scale"] == 16384.0
    assert d.final_scale == 16384.0
    assert "init_scale=16384 (2^14) skips the 2 calibration step(s)" in d.recommendations[0]


def test_climbing_infers_interval_and_recommends_from_history() -> None:
    scales, skipped = simulate(35, ceiling=1e9, init=1024.0, gi=10)
    assert infer_growth_interval(scales, skipped) == 10
    d = diagnose_scale(scales, skipped)
    assert d.pattern == "climbing"
    assert d.growth_interval == 10
    assert d.growths == [10, 20, 30]
    assert d.settings == {"init_scale": 8192.0, "growth_interval": 5}


def test_oscillating_recommendations_come_from_the_cycle() -> None:
    scales, skipped = simulate(300, ceiling=3000.0, gi=20)
    d = diagnose_scale(scales, skipped)
    assert d.pattern == "oscillating"
    assert d.calibration_skips == 5  # 65536 -> 2048
    assert len(d.later_skips) >= 2
    assert infer_backoff(scales, skipped) == 0.5
    # a skip every 20 clean steps: growth_interval 2x20 rounded to a typed number, the safe scale, a gentler back-off
    assert d.settings["growth_interval"] == 50
    assert d.settings["init_scale"] == 2048.0
    assert d.settings["backoff_factor"] == 0.71
    assert any("skips recur about every 20 clean steps" in r for r in d.recommendations)


def test_oscillating_interval_scales_with_history() -> None:
    scales, skipped = simulate(3000, ceiling=3000.0, gi=200)
    d = diagnose_scale(scales, skipped, growth_interval=200, backoff_factor=0.5)
    assert d.pattern == "oscillating"
    assert d.settings["growth_interval"] == 500  # 2 x 200 clean steps between skips, rounded up to 1/2/5 x 10^k


def test_saturated() -> None:
    # came down from 2^20 only to 2^16: the gradients fit 2^16, they are small
    scales, skipped = simulate(200, ceiling=2.0**16, init=2.0**20)
    d = diagnose_scale(scales, skipped)
    assert d.pattern == "saturated" and "2^16" in d.explanation
    high, hs = simulate(60, ceiling=1e30, init=2.0**22, gi=10)
    d2 = diagnose_scale(high, hs)
    assert d2.pattern == "saturated" and "2^24" in d2.explanation
    # bouncing off the top at 2^17: saturated, the plateau as init_scale
    top, ts = simulate(400, ceiling=2.0**17, init=2.0**10, gi=10)
    d3 = diagnose_scale(top, ts)
    assert d3.pattern in ("saturated", "oscillating")


def test_collapsed() -> None:
    d = diagnose_scale([65536.0 * 0.5**i for i in range(30)], [True] * 30)
    assert d.pattern == "collapsed"
    assert d.min_scale < 1
    assert any("bf16" in r for r in d.recommendations)
    # at its minimum: fell 10 binades, most of the end skipped, but never below 1
    scales = [2.0**16 * 0.5**i for i in range(12)]  # 2^16 down to 2^5, one step applied on the way
    skipped = [True] * 12
    skipped[3] = False
    scales[4:] = [s * 2 for s in scales[4:]]
    d2 = diagnose_scale(scales, skipped)
    assert d2.pattern == "collapsed" and d2.min_scale >= 1


def test_never_growing() -> None:
    d = diagnose_scale([1024.0] * 2500, [False] * 2500, growth_interval=2000)
    assert d.pattern == "never_growing"
    assert "scaler.update()" in d.recommendations[0]


def test_stable_and_empty() -> None:
    assert diagnose_scale([1024.0] * 50, [False] * 50).pattern == "stable"
    # 2^16 that never moved in 50 steps (growth_interval 2000) is no evidence that the gradients are small
    d = diagnose_scale([2.0**16] * 50, [False] * 50, growth_interval=2000)
    assert d.pattern == "stable" and "small" not in d.explanation
    assert "stayed at 2^16 for all 50 step(s)" in d.explanation and "growth_interval=2000" in d.explanation
    assert diagnose_scale([], []).pattern == "empty"


def test_steps_name_the_rows() -> None:
    scales, skipped = simulate(35, ceiling=1e9, init=1024.0, gi=10)
    d = diagnose_scale(scales, skipped, steps=list(range(100, 135)))
    assert d.growths == [110, 120, 130]


def test_rolling_skip_rate_and_ledger() -> None:
    sk = [False, True, True, False, True] + [False] * 5
    assert rolling_skip_rate(sk, window=4)[:6] == [0.0, 0.5, 2 / 3, 0.5, 0.75, 0.5]
    led = skip_ledger(sk, ["", "a", "b", "", "c"] + [""] * 5, None, list(range(10, 20)))
    assert led.steps == [11, 12, 14]
    assert [(r.start, r.end, r.length) for r in led.runs] == [(11, 12, 2), (14, 14, 1)]
    assert led.longest_run == 2 and led.rate == 0.3


# the command ---------------------------------------------------------------------------------

def write_log(path: Path, scales: list[float], skipped: list[bool]) -> Path:
    with StepLogWriter(path, mode="overwrite") as w:
        for i, (s, k) in enumerate(zip(scales, skipped, strict=True)):
            w.write({"step": i, "lr": 1e-3, "grad_l2_pre_clip": float("inf") if k else 1.0,
                     "grad_l2_post_clip": float("nan") if k else 1.0, "loss": 2.0 - i / 1000, "skipped": k,
                     "skip_reason": "nonfinite_grad:fc2" if k else "", "scaler_scale": s})
    return path


def test_cli_good_log(tmp_path: Path) -> None:
    scales, skipped = simulate(300, ceiling=3000.0, gi=20)
    p = write_log(tmp_path / "steps.csv", scales, skipped)
    r = runner.invoke(app, ["scaler", str(p), "--window", "100"])
    assert r.exit_code == 0, r.output
    assert "oscillating" in r.output
    assert "nonfinite_grad:fc2" in r.output
    assert "Rolling skip rate" in r.output and "window 100" in r.output
    assert "growth_interval=50" in r.output


def test_cli_missing_column(tmp_path: Path) -> None:
    p = tmp_path / "bad.csv"
    p.write_text("step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason\n0,1,1,1,1,0,\n")
    r = runner.invoke(app, ["scaler", str(p)])
    assert r.exit_code == 2
    assert "scaler_scale" in r.output and "missing" in r.output
    assert len(r.output.strip().splitlines()) == 1 or "error" in r.output.splitlines()[0]


@pytest.mark.parametrize("bad", ["0", "-1024", "inf"])
def test_cli_rejects_a_scale_that_is_not_positive(tmp_path: Path, bad: str) -> None:
    head = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"
    p = tmp_path / "a.csv"
    p.write_text(head + "0,1,1,1,1,0,,8\n1,1,1,1,1,0,,8\n2,1,1,1,1,0,," + bad + "\n")
    r = runner.invoke(app, ["scaler", str(p)])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "column scaler_scale, step 2" in lines[0] and "positive" in lines[0], r.output
    assert "Traceback" not in r.output


def test_final_is_never_below_min() -> None:
    # a skip at the last step halves the scale after it: min counts that scale ("final 2^13, min 2^14" no more)
    d = diagnose_scale([2.0**14] * 5, [False] * 4 + [True])
    assert d.final_scale == 2.0**13 and d.min_scale == 2.0**13


def test_cli_non_numeric_names_row_and_column(tmp_path: Path) -> None:
    p = write_log(tmp_path / "steps.csv", [1024.0] * 5, [False] * 5)
    lines = p.read_text().splitlines()
    lines[3] = lines[3].replace("1.998", "oops")
    p.write_text("\n".join(lines) + "\n")
    r = runner.invoke(app, ["scaler", str(p)])
    assert r.exit_code == 2
    assert "column loss" in r.output and "row 3" in r.output and "'oops'" in r.output


def test_cli_bad_skipped_flag_and_step(tmp_path: Path) -> None:
    head = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"
    p = tmp_path / "a.csv"
    p.write_text(head + "0,1,1,1,1,0,,8\n1,1,1,1,1,maybe,,8\n")
    r = runner.invoke(app, ["scaler", str(p)])
    assert r.exit_code == 2 and "column skipped" in r.output and "row 2" in r.output
    p.write_text(head + "0,1,1,1,1,0,,8\nx,1,1,1,1,0,,8\n")
    r = runner.invoke(app, ["scaler", str(p)])
    assert r.exit_code == 2 and "column step" in r.output
    r = runner.invoke(app, ["scaler", str(tmp_path / "nope.csv")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_cli_without_scaler_column_values(tmp_path: Path) -> None:
    p = tmp_path / "bf16.csv"
    with StepLogWriter(p) as w:
        for i in range(5):
            w.write({"step": i, "lr": 1e-3, "grad_l2_pre_clip": 1.0, "grad_l2_post_clip": 1.0, "loss": 1.0,
                     "skipped": False, "skip_reason": "", "scaler_scale": None})
    r = runner.invoke(app, ["scaler", str(p)])
    assert r.exit_code == 0, r.output
    assert "without GradScaler" in r.output


def test_cli_plot(tmp_path: Path) -> None:
    scales, skipped = simulate(60, ceiling=3000.0, gi=10)
    p = write_log(tmp_path / "steps.csv", scales, skipped)
    png = tmp_path / "scale.png"
    r = runner.invoke(app, ["scaler", str(p), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = runner.invoke(app, ["scaler", str(p), "--plot", str(png)])
    assert r.exit_code == 2 and "--force" in r.output
    r = runner.invoke(app, ["scaler", str(p), "--plot", str(png), "--force"])
    assert r.exit_code == 0


def test_cli_plot_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write_log(tmp_path / "steps.csv", [1024.0] * 3, [False] * 3)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = runner.invoke(app, ["scaler", str(p), "--plot", str(tmp_path / "x.png")])
    assert r.exit_code == 2
    assert "pip install matplotlib" in r.output
    assert not (tmp_path / "x.png").exists()
