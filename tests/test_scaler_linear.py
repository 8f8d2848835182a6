"""The linear scaler.py gives what the quadratic one it replaced gave, on random histories (hypothesis)."""

from __future__ import annotations

from dataclasses import asdict

from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.judge import scaler
from ampdoctor.report import scaler as worded

from . import scaler_reference as ref


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[float], list[bool]]:
    """A GradScaler-like history: powers of two moving by growths and back-offs, skip flags, sometimes random jumps."""
    n = draw(st.integers(1, 120))
    k = draw(st.integers(-3, 20))
    scales, skipped = [], []
    for _ in range(n):
        scales.append(2.0**k)
        skip = draw(st.booleans())
        skipped.append(skip)
        k += draw(st.sampled_from([-1, 0, 0, 0, 1])) if not skip else draw(st.sampled_from([-1, -1, 0, 1]))
    return scales, skipped


def _same(a: object, b: object, skip: tuple[str, ...] = ()) -> None:
    da, db = asdict(a), asdict(b)  # type: ignore[call-overload]
    assert da.keys() == db.keys()
    for key in set(da) - set(skip):
        x, y = da[key], db[key]
        assert x == y or (x != x and y != y), key  # NaN == NaN here


@settings(max_examples=300, deadline=None)
@given(histories(), st.sampled_from([None, 1, 3, 2000]), st.sampled_from([None, 0.5]))
def test_linear_diagnosis_equals_the_reference(h: tuple[list[float], list[bool]], gi: int | None, bo: float | None) -> None:
    scales, skipped = h
    assert scaler.infer_backoff(scales, skipped) == ref.infer_backoff(scales, skipped)
    assert scaler.infer_growth_interval(scales, skipped) == ref.infer_growth_interval(scales, skipped)
    assert scaler.rolling_skip_rate(skipped, 7) == ref.rolling_skip_rate(skipped, 7)
    assert scaler._longest_run(skipped) == ref._longest_run(skipped)
    later = [i for i, s in enumerate(skipped) if s]
    assert scaler._clean_runs_between(later, len(skipped), skipped) == ref._clean_runs_between(later, len(skipped), skipped)
    _same(scaler.skip_ledger(skipped, None, scales), ref.skip_ledger(skipped, None, scales))
    new = worded.diagnose_scale(scales, skipped, growth_interval=gi, backoff_factor=bo)
    old = ref.diagnose_scale(scales, skipped, growth_interval=gi, backoff_factor=bo)
    _same(new, old, skip=("min_scale", "pattern", "explanation", "recommendations", "settings"))
    # intended change 1: the minimum counts the scale after the last update ("final 2^13, min 2^14")
    assert new.min_scale == min(old.min_scale, old.final_scale) <= new.final_scale
    # intended change 2: a scale that never moved is "stable", not "saturated", and says why it tells nothing
    unmoved = not new.growths and not new.backoffs and not new.later_skips
    if unmoved and new.pattern == "stable":
        assert old.pattern in ("stable", "saturated") and "for all" in new.explanation
    else:
        assert (new.pattern, new.explanation, new.recommendations, new.settings) == \
            (old.pattern, old.explanation, old.recommendations, old.settings)
