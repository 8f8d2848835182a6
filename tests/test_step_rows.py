"""A recorded step's rows as one host matrix (``StepStats.set_rows``): the dicts made from it on first read, the
Monitor's per-step checks read from the matrix, and the same answers as the dicts give."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ampdoctor import Monitor
from ampdoctor.records import NCOLS, Col, StepStats, nonfinite

KINDS = ("act", "grad", "pgrad", "param")


def _row(bad: bool, numel: float = 4.0) -> np.ndarray:
    r = np.zeros(NCOLS)
    r[Col.NUMEL] = numel
    r[Col.NORMAL] = numel - (1 if bad else 0)
    r[Col.NAN] = 1.0 if bad else 0.0
    r[Col.ABSMAX] = 1.5
    r[Col.MIN_NONZERO] = 0.25
    return r


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KINDS), st.booleans()), max_size=30), st.sampled_from(KINDS),
       st.booleans())
def test_the_matrix_answers_as_the_dicts_do(rows: list[tuple[str, bool]], kind: str, read_first: bool) -> None:
    keys = [(k, i if k in ("act", "grad") else f"p{i}") for i, (k, _) in enumerate(rows)]
    matrix = np.stack([_row(b) for _, b in rows]) if rows else np.zeros((0, NCOLS))
    lazy = StepStats(0)
    lazy.set_rows(keys, matrix)
    eager = StepStats(0)
    for (k, ident), r in zip(keys, matrix, strict=True):
        getattr(eager, k)[ident] = r
    if read_first:  # made into dicts already: the same answers from them
        _ = lazy.act
        assert lazy.row_matrix is None
    want_bad = any(nonfinite(r) > 0 for r in getattr(eager, kind).values())
    assert lazy.any_nonfinite(kind) == want_bad
    assert lazy.has(kind) == bool(getattr(eager, kind))
    for k in KINDS:
        got, want = getattr(lazy, k), getattr(eager, k)
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[i], want[i]) for i in want)


def test_a_dict_set_before_it_is_read_keeps_the_other_kinds() -> None:
    s = StepStats(3)
    s.set_rows([("act", 0), ("pgrad", "w")], np.stack([_row(False), _row(True)]))
    s.pgrad = {}  # (the recipe drops rows taken with a stale scale)
    assert s.pgrad == {} and list(s.act) == [0]
    assert not s.any_nonfinite("pgrad") and not s.has("pgrad")


def test_a_monitor_step_leaves_its_rows_as_one_matrix_until_read() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, None, quiet=True)
    loss = model(torch.randn(3, 4)).pow(2).mean()
    rec = mon.step(loss)
    st_ = rec.stats
    assert st_ is not None and st_.row_matrix is not None  # nothing read the dicts on the way
    keys, matrix = st_.row_matrix
    assert matrix.shape == (len(keys), NCOLS)
    assert set(st_.pgrad) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # read: made now
    assert st_.row_matrix is None
    assert all(math.isclose(st_.pgrad[n][Col.NUMEL], p.numel()) for n, p in model.named_parameters())
    mon.close()


def _run(one_read: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[Any]]:
    """Six monitored steps of a small MLP under FP16 autocast, the last with an Inf gradient, taking the one-read
    path or not."""
    from ampdoctor.watch import fused
    from ampdoctor.watch.hooks import Hooks

    calls = []
    real = Hooks.grads_with_norms

    def spy(self: Hooks, params: Any, grads: Any) -> Any:
        out = real(self, params, grads) if one_read else None
        calls.append(out is not None)
        return out

    monkeypatch.setattr(Hooks, "grads_with_norms", spy)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    mon = Monitor(model, opt, scaler, quiet=True)
    g = torch.Generator().manual_seed(2)
    recs, stats = [], []
    for i in range(6):
        x = torch.randn(5, 6, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean() * (3e4 if i == 5 else 1.0)  # the last: finite, its FP16 gradients not
        rec = mon.step(loss)
        recs.append((rec.step, rec.loss, rec.grad_l2_pre_clip, rec.grad_l2_post_clip, rec.skipped, rec.nonfinite_count,
                     rec.scale_after))
        st_ = rec.stats
        assert st_ is not None
        stats.append({k: dict(v) for k, v in (("pgrad", st_.pgrad), ("act", st_.act), ("grad", st_.grad),
                                               ("param", st_.param))})
    mon.close()
    assert calls and all(c == (one_read and fused.kernel() is not None) for c in calls)
    return recs, stats


def test_gradient_rows_and_norms_from_one_read_are_those_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a recorded CPU step the recipe takes its gradient norms and their rows from one pass (the kernel);
    the step's records, norms and skip are exactly those of the two separate passes."""
    from ampdoctor.watch import fused

    if fused.build_locked(wait=True) != 0:  # a finished build loads; one builder per machine (xdist workers)
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    with monkeypatch.context() as m:
        two = _run(False, m)
    one = _run(True, monkeypatch)
    assert str(one[0]) == str(two[0])  # (NaN equal to NaN)
    assert one[0][-1][4] and one[0][-1][5] > 0 and math.isfinite(one[0][-1][1])  # (the last step overflowed: skipped, its gradients counted)
    for a, b in zip(one[1], two[1], strict=True):
        assert a.keys() == b.keys()
        for kind in a:
            assert list(a[kind]) == list(b[kind])  # same keys, same order
            for k in a[kind]:
                assert np.array_equal(np.asarray(a[kind][k]), np.asarray(b[kind][k]), equal_nan=True), (kind, k)
