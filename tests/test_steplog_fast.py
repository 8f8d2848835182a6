"""The fast read of a clean step log gives exactly what the validating reader gives; anything else falls back."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampdoctor.watch.steplog_fast as fast
from ampdoctor.watch.steplog import StepLogError
from ampdoctor.watch.steplog_read import read_step_log

HEADER = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale"
NUM = st.sampled_from(["0.5", "1e-3", "nan", "NaN", "inf", "-inf", "Infinity", "1e400", " 2", "3 ", "-0", "7"])
MAYBE = st.one_of(NUM, st.just(""))
ODD = st.sampled_from(["", "x", "1,2", '"q"', "0.5.5", "  "])


@st.composite
def logs(draw: st.DrawFn) -> str:
    rows = [HEADER + draw(st.sampled_from(["", ",note"]))]
    extra = rows[0].endswith(",note")
    for _ in range(draw(st.integers(0, 12))):
        step = draw(st.sampled_from(["0", "1", "2", "5", "3.0", "x", " 4"]))
        fields = [step, draw(MAYBE), draw(NUM), draw(NUM), draw(NUM),
                  draw(st.sampled_from(["0", "1", "true", "False", "1.0", "2", " 1"])),
                  draw(st.sampled_from(["", "nonfinite_grad:head.weight", "a b"])), draw(MAYBE)]
        if extra:
            fields.append(draw(st.sampled_from(["", "n", "nan"])))
        if draw(st.integers(0, 9)) == 0:  # now and then a broken field or a missing one
            i = draw(st.integers(0, len(fields) - 1))
            fields[i] = draw(ODD)
            if draw(st.booleans()):
                fields.pop()
        rows.append(",".join(fields))
    return "\n".join(rows) + draw(st.sampled_from(["\n", "\n\n"]))


def _read(path: Path, use_fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[str, pd.DataFrame | None, list[str]]:
    with monkeypatch.context() as m:
        if not use_fast:
            m.setattr(fast, "read_clean", lambda *a, **k: None)
        try:
            log = read_step_log(path)
        except StepLogError as e:
            return str(e), None, []
        return "", log.frame, log.notes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(logs())
def test_fast_read_equals_the_validating_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    path = tmp_path / "steps.csv"
    path.write_text(text)
    err_fast, df_fast, notes_fast = _read(path, True, monkeypatch)
    err_slow, df_slow, notes_slow = _read(path, False, monkeypatch)
    assert err_fast == err_slow and notes_fast == notes_slow
    if df_slow is not None:
        assert df_fast is not None
        pd.testing.assert_frame_equal(df_fast, df_slow)


def test_a_clean_log_takes_the_fast_path(tmp_path: Path) -> None:
    path = tmp_path / "steps.csv"
    path.write_text(HEADER + "\n0,,1.5,1.5,2.0,0,,65536\n1,,inf,inf,nan,1,nonfinite_grad:fc,65536\n")
    assert fast.read_clean(path.read_text(), HEADER.split(","), ("lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss",
                           "scaler_scale"), ("lr", "scaler_scale"), {"1"}, {"0"}) is not None
    log = read_step_log(path)
    assert log.skipped == [False, True] and log.scales == [65536.0, 65536.0] and log.reasons == ["", "nonfinite_grad:fc"]
