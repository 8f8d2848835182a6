"""Scaled FP8 operand statistics and block-scaled (MXFP8, NVFP4) shares against a direct emulation.

The emulation is written from the formats' definitions in plain Python floats (float64), element by
element: round-to-nearest-even by hand (``round`` is half-to-even), no torch cast. ``ampdoctor.scaled``
reduces with torch's own casts on the tensor's device; both must agree exactly on the counts and,
for the SQNR, within float64 rounding.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.formats import FP8_E4M3, FP8_E5M2, Format
from ampdoctor.scaled import (
    MXFP8,
    NVFP4,
    as_dict,
    block_stats,
    operand_stats,
)

# the direct emulation -------------------------------------------------------------------------------


def rne(v: float, mbits: int, min_normal: float, max_value: float) -> float:
    """Round ``v`` to nearest-even in a format with ``mbits`` fraction bits (saturating at ``max_value``)."""
    if v == 0:
        return 0.0
    a = min(abs(v), max_value)
    e = max(math.floor(math.log2(a)), math.floor(math.log2(min_normal)))
    ulp = 2.0 ** (e - mbits)
    q = round(a / ulp) * ulp
    return math.copysign(min(q, max_value), v)


def f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def emulate_operand(rows: list[list[float]], fmt: Format, rowwise: bool, pow2: bool) -> dict[str, float]:
    mn = math.floor(math.log2(fmt.min_normal))
    flat = [v for r in rows for v in r]
    n = len(flat)
    amaxes = [max(abs(v) for v in r) for r in rows] if rowwise else [max(abs(v) for v in flat)] * len(rows)
    scales = []
    for a in amaxes:
        s = f32(fmt.max / max(a, 1e-12))
        if pow2:
            s = 2.0 ** math.floor(math.log2(s))
        scales.append(s)
    sat = flushed = 0
    sig = noise = 0.0
    row_db = []
    for r, s in zip(rows, scales, strict=True):
        rs = rn = 0.0
        for v in r:
            y = f32(v * s)  # torchao multiplies in float32
            if abs(y) >= fmt.overflow_threshold:
                sat += 1
            q = rne(y, fmt.mantissa_bits, 2.0**mn, fmt.max)
            if v != 0 and q == 0:
                flushed += 1
            d = q / s
            rs += v * v
            rn += (v - d) ** 2
        sig += rs
        noise += rn
        row_db.append(20 * math.log10(math.sqrt(rs) / math.sqrt(rn)) if rn > 0 else (math.inf if rs > 0 else math.nan))
    db = 20 * math.log10(math.sqrt(sig) / math.sqrt(noise)) if noise > 0 else math.inf
    ranked = [math.inf if math.isnan(d) else d for d in row_db]
    return {"amax": max(abs(v) for v in flat), "scale": min(scales), "saturated": sat / n, "flushed": flushed / n,
            "sqnr_db": db, "worst_row_sqnr_db": min(ranked) if rowwise else db}


def emulate_blocks(rows: list[list[float]], name: str) -> dict[str, float]:
    block = 32 if name == "mxfp8" else 16
    tensor_amax = max(abs(v) for r in rows for v in r)
    blocks = exceeding = flushed = sat = 0
    for r in rows:
        for i in range(0, len(r), block):
            b = r[i:i + block] + [0.0] * (block - len(r[i:i + block]))
            real = len(r[i:i + block])
            amax = max(abs(v) for v in b)
            if name == "mxfp8":
                e = math.floor(math.log2(f32(amax))) if f32(amax) >= 2.0**-126 else -127
                div = max(2.0 ** min(max(e - 8, -127), 127), 2.0**-126)
                scaled = [f32(v) / div for v in b]
                q = [rne(v, 3, 2.0**-6, 448.0) for v in scaled]
                over = FP8_E4M3.overflow_threshold
            else:
                t = f32(tensor_amax / 2688.0) if tensor_amax > 0 else 1.0
                bs = f32(f32(amax / 6.0) / t)
                bs8 = rne(min(max(bs, 2.0**-6), 448.0), 3, 2.0**-6, 448.0)
                div = f32(t * bs8)
                recip = f32(1.0 / div)
                scaled = [f32(f32(v) * recip) for v in b]
                q = [rne(v, 1, 1.0, 6.0) for v in scaled]
                over = 7.0
            fl = sum(1 for v, z in zip(b[:real], q[:real], strict=True) if v != 0 and z == 0)
            sa = sum(1 for v in scaled[:real] if abs(v) >= over)
            blocks += 1
            flushed += fl
            sat += sa
            exceeding += 1 if fl else 0
    return {"blocks": blocks, "blocks_exceeding": exceeding, "flushed": flushed, "saturated": sat}


# strategies: magnitudes over many binades, zeros, an outlier row ------------------------------------

def _value() -> st.SearchStrategy[float]:
    mag = st.floats(min_value=-40, max_value=20)
    return st.one_of(st.just(0.0), st.tuples(st.sampled_from([-1.0, 1.0]), mag).map(lambda t: f32(t[0] * 2.0 ** t[1])))


def _rows(width: st.SearchStrategy[int]) -> st.SearchStrategy[list[list[float]]]:
    return width.flatmap(lambda w: st.lists(st.lists(_value(), min_size=w, max_size=w), min_size=1, max_size=6))


def _tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


@settings(max_examples=150, deadline=None)
@given(rows=_rows(st.integers(1, 12)), fmt=st.sampled_from([FP8_E4M3, FP8_E5M2]), rowwise=st.booleans(),
       pow2=st.booleans())
def test_operand_stats_match_the_emulation(rows: list[list[float]], fmt: Format, rowwise: bool, pow2: bool) -> None:
    if all(v == 0 for r in rows for v in r):
        rows[0][0] = 1.0
    got = as_dict(operand_stats(_tensor(rows), fmt, rowwise=rowwise, round_pow2=pow2))
    want = emulate_operand(rows, fmt, rowwise, pow2)
    assert got["amax"] == want["amax"]
    assert got["scale"] == want["scale"]
    assert got["saturated"] == want["saturated"]
    assert got["flushed"] == want["flushed"]
    assert got["rowwise_flushed"] == emulate_operand(rows, FP8_E4M3, True, True)["flushed"]
    for k in ("sqnr_db", "worst_row_sqnr_db"):
        if math.isinf(want[k]):
            assert math.isinf(got[k])
        else:
            assert got[k] == pytest_approx(want[k])


def pytest_approx(v: float) -> object:
    import pytest

    return pytest.approx(v, rel=1e-9, abs=1e-9)


def test_outlier_row_flushes_the_others_tensorwise_not_rowwise() -> None:
    """An outlier row under tensorwise scaling sets the scale: the other rows' values fall below E4M3's smallest
    subnormal times that scale and flush; rowwise scaling gives each row its own scale and flushes nothing."""
    x = torch.full((4, 8), 1e-3)
    x[0] = 1e4  # 1e7 times the others: E4M3 spans 448 / 2^-9 ≈ 2.3e5
    tw = as_dict(operand_stats(x, FP8_E4M3))
    rw = as_dict(operand_stats(x, FP8_E4M3, rowwise=True, round_pow2=True))
    assert tw["flushed"] == 0.75 and tw["saturated"] == 0
    assert rw["flushed"] == 0 and rw["rows"] == 4
    assert rw["sqnr_db"] > 25


def test_a_stale_scale_saturates() -> None:
    """A scale taken from other values (half this tensor's amax) sends the top values past E4M3's max."""
    x = torch.linspace(-2.0, 2.0, 101)
    stale = torch.tensor(448.0 / 1.0)
    d = as_dict(operand_stats(x, FP8_E4M3, scale=stale))
    assert d["saturated"] == sum(1 for v in x.tolist() if abs(v) * 448.0 >= 464.0) / 101


def test_zero_operand_has_the_floor_scale() -> None:
    d = as_dict(operand_stats(torch.zeros(3, 4), FP8_E4M3))
    assert d["amax"] == 0 and d["scale"] == float(torch.tensor(448.0 / 1e-12, dtype=torch.float32))
    assert d["flushed"] == 0 and math.isnan(d["sqnr_db"])


@settings(max_examples=150, deadline=None)
@given(rows=_rows(st.integers(1, 70)), name=st.sampled_from(["mxfp8", "nvfp4"]))
def test_block_stats_match_the_emulation(rows: list[list[float]], name: str) -> None:
    fmt = MXFP8 if name == "mxfp8" else NVFP4
    got = dict(zip(("numel", "blocks", "blocks_exceeding", "flushed", "saturated", "zero"),
                   block_stats(_tensor(rows), fmt).tolist(), strict=True))
    want = emulate_blocks(rows, name)
    for k, v in want.items():
        assert got[k] == v, (k, got, want)


def test_mxfp8_block_range() -> None:
    """A block holding 1 and 2^-20: the shared scale 2^-8 puts 2^-20 at 2^-12, below E4M3's smallest subnormal 2^-9."""
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 1.0, 2.0**-20
    x[0, 32], x[0, 33] = 1.0, 2.0**-10  # 2^-2 after the scale: kept
    got = block_stats(x, MXFP8).tolist()
    assert got[:5] == [64, 2, 1, 1, 0]


def test_nvfp4_block_range() -> None:
    """E2M1 keeps 0.5 as its smallest value: in a block scaled to 6 at its amax, 1/24 of the amax rounds to 0."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, 0.2
    got = block_stats(x, NVFP4).tolist()
    assert got[:5] == [16, 1, 1, 1, 0]
