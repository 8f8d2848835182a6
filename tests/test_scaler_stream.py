"""`ampdoctor scaler` reads a log a block at a time: the same report as the whole log read at once."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import ampdoctor.cli.scaler as cli_scaler
from ampdoctor.cli.app import app
from ampdoctor.judge.log_digest import Envelope, LedgerTracker, RateTracker
from ampdoctor.judge.scale_tracker import ScaleTracker
from ampdoctor.judge.scaler import diagnose_scale, rolling_skip_rate, skip_ledger

from .test_scaler import simulate
from .test_scaler_linear import histories

runner = CliRunner()
HEAD = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"


def _cuts(data: st.DataObject, n: int) -> list[int]:
    return sorted(set(data.draw(st.lists(st.integers(0, n), max_size=6))) | {0, n})


@settings(max_examples=120, deadline=None)
@given(histories(), st.data(), st.sampled_from([None, 3, 2000]))
def test_a_history_fed_in_pieces_gives_the_whole_diagnosis(h: tuple[list[float], list[bool]], data: st.DataObject,
                                                           gi: int | None) -> None:
    scales, skipped = h
    steps = [10 + 3 * i for i in range(len(scales))]
    cuts = _cuts(data, len(scales))
    t = ScaleTracker()
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        t.feed(scales[a:b], skipped[a:b], steps[a:b])
    assert asdict(t.diagnose(growth_interval=gi)) == asdict(diagnose_scale(scales, skipped, growth_interval=gi, steps=steps))


@settings(max_examples=120, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=150), st.data(), st.sampled_from([1, 3, 7, 1000]))
def test_ledger_and_rate_in_pieces_equal_the_whole(flags: list[bool], data: st.DataObject, window: int) -> None:
    n = len(flags)
    steps = np.arange(5, 5 + n, dtype=np.int64)
    reasons = np.array([f"r{i % 3}" if f else "" for i, f in enumerate(flags)], dtype=object)
    scales = np.array([2.0 ** (i % 5) for i in range(n)])
    sk = np.array(flags)
    cuts = _cuts(data, n)
    led, rate = LedgerTracker(keep=4), RateTracker(window, 0.3)
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        led.feed(steps[a:b], sk[a:b], reasons[a:b], scales[a:b])
        rate.feed(steps[a:b], sk[a:b])
    whole = skip_ledger(flags, reasons.tolist(), scales.tolist(), steps.tolist())
    assert (led.count, led.total, led.n_runs, led.longest) == (whole.count, whole.total_steps, len(whole.runs), whole.longest_run)
    assert list(led.reasons_by_count().items()) == list(whole.by_reason().items())
    at = dict(zip(whole.steps, whole.scales, strict=True))
    assert [(r.start, r.end, r.length, r.reasons, r.scale) for r in led.runs] == \
        [(r.start, r.end, r.length, list(dict.fromkeys(r.reasons)), at[r.start]) for r in whole.runs[:4]]
    rates = rolling_skip_rate(flags, window)
    start = min(window, 100)
    start = start if n > start else 0
    judged = rates[start:]
    peak = max(judged)
    assert rate.summary() == (rates[-1], int(steps[start]), peak, int(steps[start + judged.index(peak)]),
                              sum(r > 0.3 for r in judged))


def test_the_plot_envelope_keeps_the_true_extremes() -> None:
    rng = np.random.default_rng(0)
    y = rng.standard_normal(100_000)
    y[77_777] = 50.0
    y[12_345] = -60.0
    env = Envelope(cap=100)
    for a in range(0, y.size, 9_999):
        env.add(np.arange(a, min(a + 9_999, y.size), dtype=np.float64), y[a:a + 9_999])
    assert len(env.x) <= 200 and env.width > 1
    assert env.hi.max() == 50.0 and env.lo.min() == -60.0
    assert env.x[0] == 0 and (np.diff(env.x) > 0).all()
    small = Envelope(cap=100)
    small.add(np.arange(5.0), y[:5])
    assert small.width == 1 and small.lo.tolist() == y[:5].tolist()


def _log(path: Path, scales: Sequence[float | None], skipped: Sequence[bool], reasons: list[str] | None = None,
         tail: str = "") -> Path:
    with path.open("w") as f:
        f.write(HEAD)
        for i, (s, k) in enumerate(zip(scales, skipped, strict=True)):
            r = reasons[i] if reasons else (f"nonfinite_grad:fc{i % 3}" if k else "")
            f.write(f"{i},0.001,1.0,1.0,{2.0 - i / 1000},{int(k)},{r},{'' if s is None else repr(s)}\n")
        f.write(tail)
    return path


def _logs(tmp: Path) -> list[Path]:
    rng = random.Random(3)
    sc, sk = simulate(600, ceiling=3000.0, gi=20)
    reasons = ["applied:nonfinite_loss" if i in (50, 77) else ("nonfinite_loss" if k else "") for i, k in enumerate(sk)]
    flags = [rng.random() < 0.05 for _ in range(800)]
    return [
        _log(tmp / "osc.csv", *simulate(900, ceiling=3000.0, gi=7)),
        _log(tmp / "applied.csv", sc, sk, reasons, tail="600,0.001,1.0"),
        _log(tmp / "coll.csv", *simulate(300, ceiling=0.25, init=4.0, gi=50)),
        _log(tmp / "sat.csv", *simulate(900, ceiling=2.0**17, init=2.0**16, gi=40)),
        _log(tmp / "none.csv", [None] * 50, [False] * 49 + [True]),
        _log(tmp / "lead.csv", [None] * 10 + [1024.0] * 40 + [None] * 5 + [512.0] * 10, [False] * 65),
        _log(tmp / "many.csv", [1024.0] * 800, flags),
    ]


def _report(monkeypatch: pytest.MonkeyPatch, block: int, *args: str) -> str:
    monkeypatch.setattr(cli_scaler, "BLOCK_BYTES", block)
    r = runner.invoke(app, ["scaler", *args], env={"COLUMNS": "100"})
    assert r.exit_code in (0, 1), r.output
    return r.output


def test_blocks_of_any_size_give_the_whole_log_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for log, window in zip(_logs(tmp_path), ["1000", "7", "1000", "7", "1000", "7", "50"], strict=True):
        whole = _report(monkeypatch, 1 << 30, str(log), "--window", window)
        assert "steps" in whole and "Skip ledger" in whole
        for block in (300, 4096):
            assert _report(monkeypatch, block, str(log), "--window", window) == whole, (log.name, block)


def test_a_resumed_log_is_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a run resumed from step 40 redid steps 40..59: the later rows win, as read_step_log reads them
    sc, sk = simulate(100, ceiling=3000.0, gi=5)
    p = _log(tmp_path / "a.csv", sc, sk)
    lines = p.read_text().splitlines(keepends=True)
    redo = [ln.replace(",1.0,1.0,", ",1.0,2.0,", 1) for ln in lines[41:61]]
    p.write_text("".join(lines[:61] + redo + lines[61:]))
    out = _report(monkeypatch, 97, str(p))
    assert "20 step(s) were logged twice" in out and "100 steps (0..99)" in out
    assert out == _report(monkeypatch, 1 << 30, str(p))


def test_a_bad_scale_is_named_from_a_later_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _log(tmp_path / "a.csv", [8.0] * 200 + [0.0] + [8.0] * 10, [False] * 211)
    monkeypatch.setattr(cli_scaler, "BLOCK_BYTES", 97)
    r = runner.invoke(app, ["scaler", str(p)])
    assert r.exit_code == 2 and "column scaler_scale, step 200: 0 is not a loss scale" in r.output


def test_the_plot_of_a_long_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _log(tmp_path / "osc.csv", *simulate(10_000, ceiling=3000.0, gi=20))
    monkeypatch.setattr(cli_scaler, "BLOCK_BYTES", 1 << 16)
    r = runner.invoke(app, ["scaler", str(p), "--plot", str(tmp_path / "s.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
