"""The healthy summary quotes the windowed losses the stall rule compared, and they give its ratio exactly."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.judge.measures import stall_ratio
from ampdoctor.judge.progress import loss_window
from ampdoctor.judge.thresholds import MIN_STALL_STEPS
from ampdoctor.report.words.verdicts import describe


def _stage(losses: list[float]) -> SimpleNamespace:
    return SimpleNamespace(records=[SimpleNamespace(loss=v) for v in losses])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 100.0), min_size=0, max_size=60), st.lists(st.floats(0.01, 100.0), min_size=0, max_size=60))
def test_the_window_gives_the_rules_ratio(fp32: list[float], target: list[float]) -> None:
    a, b = _stage(target), _stage(fp32)
    w = loss_window(a, b, MIN_STALL_STEPS)
    r = stall_ratio(a, b)  # type: ignore[arg-type]
    assert (w is None) == (r is None)
    if w is not None:
        assert w.ratio == r


def test_description_names_the_windows() -> None:
    fp32 = [10.0 - 0.1 * i for i in range(48)]  # head mean over 0-11: 9.45; tail over 36-47: 5.85
    amp = [10.0 - 0.1 * i + (3.0 if i == 47 else 0.0) for i in range(48)]  # one noisy last step
    w = loss_window(_stage(amp), _stage(fp32))
    assert w is not None and w.window == 12
    text = describe(w, "amp")
    assert text.startswith("mean loss over steps 36-47: amp 6.1, FP32 5.85, from FP32's 9.45 over steps 0-11")
    assert text.endswith(f"{w.ratio:.0%} of FP32's progress")
