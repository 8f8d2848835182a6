"""The step log: format, append/refuse rules, the validating reader, and a process killed mid-run."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ampdoctor.watch.steplog import COLUMNS, StepLogError, StepLogWriter, format_row
from ampdoctor.watch.steplog_read import read_step_log

ROOT = Path(__file__).resolve().parent.parent


def rec(step: int, **kw: object) -> dict[str, object]:
    base: dict[str, object] = {"step": step, "lr": 1e-3, "grad_l2_pre_clip": 2.0, "grad_l2_post_clip": 1.0, "loss": 0.5,
                               "skipped": False, "skip_reason": "", "scaler_scale": 65536.0}
    base.update(kw)
    return base


def test_columns_are_the_seed_columns() -> None:
    assert COLUMNS == ("step", "lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss", "skipped", "skip_reason",
                       "scaler_scale")


def test_format_row_round_trips_specials(tmp_path: Path) -> None:
    line = format_row(rec(3, loss=float("nan"), grad_l2_pre_clip=float("inf"), grad_l2_post_clip=float("-inf"),
                          skipped=True, skip_reason="nonfinite_grad:a,b", scaler_scale=None, extra="ignored"))
    assert line == '3,0.001,inf,-inf,nan,1,"nonfinite_grad:a,b",\n'
    p = tmp_path / "s.csv"
    with StepLogWriter(p) as w:
        w.write(rec(0, loss=0.1 + 0.2))
        w.write(rec(1, loss=float("nan"), skipped=True, skip_reason="nonfinite_grad:a,b"))
    log = read_step_log(p)
    assert log.losses[0] == 0.1 + 0.2  # repr: exact
    assert math.isnan(log.losses[1]) and log.skipped == [False, True] and log.reasons[1] == "nonfinite_grad:a,b"


def test_dataclass_records() -> None:
    @dataclass
    class R:
        step: int
        lr: float
        grad_l2_pre_clip: float
        grad_l2_post_clip: float
        loss: float
        skipped: bool
        skip_reason: str
        scaler_scale: float | None
        batch: int = 0

    assert format_row(R(1, 0.1, 1.0, 1.0, 2.0, False, "", None)) == "1,0.1,1.0,1.0,2.0,0,,\n"


def test_never_truncates_without_being_asked(tmp_path: Path) -> None:
    p = tmp_path / "steps.csv"
    with StepLogWriter(p) as w:
        for i in range(3):
            w.write(rec(i))
    # a fresh run (step 0) onto a log with rows: refused, file untouched
    before = p.read_text()
    with pytest.raises(StepLogError, match="already holds 3 step"):
        StepLogWriter(p).write(rec(0))
    with pytest.raises(StepLogError, match="exists"):
        StepLogWriter(p, mode="new").write(rec(0))
    assert p.read_text() == before
    # a resumed run appends
    with StepLogWriter(p) as w:
        w.write(rec(3))
    assert read_step_log(p).steps == [0, 1, 2, 3]
    # other columns: refused
    with pytest.raises(StepLogError, match="has columns"):
        StepLogWriter(p, extra_columns=("x",)).write(rec(4))
    # the user's say
    with StepLogWriter(p, mode="overwrite") as w:
        w.write(rec(0))
    assert read_step_log(p).steps == [0]


def test_append_cuts_a_half_written_line(tmp_path: Path) -> None:
    p = tmp_path / "steps.csv"
    with StepLogWriter(p) as w:
        w.write(rec(0))
        w.write(rec(1))
    with open(p, "a") as f:
        f.write("2,0.001,2.0")  # killed mid-write
    log = read_step_log(p)
    assert log.steps == [0, 1] and "incomplete" in log.notes[0]
    with StepLogWriter(p) as w:
        w.write(rec(2))
    assert read_step_log(p).steps == [0, 1, 2]
    assert read_step_log(p).notes == []


def test_reader_keeps_the_later_row_of_a_redone_step(tmp_path: Path) -> None:
    p = tmp_path / "steps.csv"
    with StepLogWriter(p) as w:
        for i in range(4):
            w.write(rec(i, loss=1.0))
    with StepLogWriter(p) as w:  # resumed from a checkpoint at step 2
        w.write(rec(2, loss=9.0))
    log = read_step_log(p)
    assert log.steps == [0, 1, 2, 3] and log.losses[2] == 9.0
    assert "logged twice" in log.notes[0]


def test_reader_errors_name_column_and_row(tmp_path: Path) -> None:
    p = tmp_path / "x.csv"
    p.write_text("step,loss\n0,1\n")
    with pytest.raises(StepLogError, match="missing column"):
        read_step_log(p)
    p.write_text(",".join(COLUMNS) + "\n0,0.1,1,1,1,0,,\n1,0.1,1,abc,1,0,,\n")
    with pytest.raises(StepLogError, match=r"column grad_l2_post_clip, row 2 \(line 3\): 'abc'"):
        read_step_log(p)
    p.write_text(",".join(COLUMNS) + "\n0,0.1,1,1,,0,,\n")
    with pytest.raises(StepLogError, match="column loss, row 1"):
        read_step_log(p)
    p.write_text(",".join(COLUMNS) + "\n0,0.1,1,1,1,0,,,9,9\n")
    with pytest.raises(StepLogError, match="fields"):
        read_step_log(p)
    p.write_text("")
    with pytest.raises(StepLogError, match="empty"):
        read_step_log(p)


KILLED = textwrap.dedent(
    """
    import sys, time, torch
    from torch import nn
    from ampdoctor.engine.monitor import Monitor
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, torch.amp.GradScaler("cpu", init_scale=256.0), log=sys.argv[1], inject_inf_at={7, 8})
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for i in range(100000):
        with mon.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        r = mon.step(loss)
        print(r.step, flush=True)
        time.sleep(0.002)
    """
)


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_killed_process_loses_no_finished_step(tmp_path: Path) -> None:
    log = tmp_path / "steps.csv"
    script = tmp_path / "train.py"
    script.write_text(KILLED)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script), str(log)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    last = -1
    deadline = time.monotonic() + 60
    try:
        while last < 40 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            last = int(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert last >= 40, "the training subprocess did not get far enough"
    parsed = read_step_log(log)  # parses, no malformed row
    steps = parsed.steps
    assert steps[: last + 1] == list(range(last + 1))  # every step it reported finished is there
    assert steps == list(range(len(steps)))
    assert parsed.skipped[7] and parsed.skipped[8]
    assert parsed.reasons[7].startswith("nonfinite_grad:")
