"""The Triton kernel gives the eager rows exactly, on random float32 bit patterns, run by Triton's interpreter
on the CPU (``TRITON_INTERPRET=1``; marker ``triton``, skipped where Triton is not installed)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.formats import BF16, FP8_E4M3, FP8_E5M2, FP16
from ampdoctor.watch.stats import eager_stats

from .test_stats_props import bit_patterns

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)"),
]

FORMATS = [FP16, BF16, FP8_E4M3, FP8_E5M2]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _stats(ts: list[torch.Tensor], fmt: object, scale: float = 1.0) -> torch.Tensor:
    from ampdoctor.watch import triton_stats

    dev = [t.cuda() for t in ts] if torch.cuda.is_available() else ts  # a GPU: compiled; else the interpreter
    got = triton_stats.triton_stats(dev, fmt, scale)  # type: ignore[arg-type]
    assert got is not None
    return got.cpu()


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_triton_equals_eager_on_random_bits(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(FORMATS))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    sizes = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=4))
    ts = []
    for n in sizes:
        bits = data.draw(st.lists(bit_patterns(fmt), min_size=n, max_size=n))
        ts.append(torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy()).to(dtype))
    got = _stats(ts, fmt)
    want = eager_stats(ts, fmt)  # type: ignore[arg-type]
    assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want), (got, want)


def test_triton_across_blocks_with_a_scale() -> None:
    from ampdoctor.watch import triton_stats

    g = torch.Generator().manual_seed(0)
    big = torch.randint(-2**31, 2**31 - 1, (2 * triton_stats.BLOCK + 5,), generator=g, dtype=torch.int64).to(torch.int32)
    ts = [big.view(torch.float32), torch.empty(0), torch.randn(7, generator=g).half(), torch.randn(3, 5, generator=g)]
    for fmt in FORMATS:
        assert torch.equal(_stats(ts, fmt), eager_stats(ts, fmt))
    assert torch.equal(_stats(ts, FP16, 2.0**-12), eager_stats(ts, FP16, 2.0**-12))
