"""A recorded step's rows as one host matrix (``StepStats.set_rows``): the dicts made from it on first read, the
Monitor's per-step checks read from the matrix, and the same answers as the dicts give."""

from __future__ import annotations

import math

import numpy as np
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
