"""The cast thresholds and the stats columns are exactly what ``tensor.to(dtype)`` does."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ampdoctor.engine.layers import scale_window
from ampdoctor.formats import BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, Format, get_format
from ampdoctor.records import BINADE_MIN, NBINADES, Col
from ampdoctor.watch.stats import binade_histogram, tensor_stats

ALL = list(FORMATS.values())
CATS = [Col.ZERO, Col.UNDERFLOW, Col.SUBNORMAL, Col.NORMAL, Col.OVERFLOW, Col.POSINF, Col.NEGINF, Col.NAN]


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _next(x: float, direction: float) -> float:
    return float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(direction, dtype=torch.float32)))


def expected_category(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Column index per element, from the real cast (float32 input)."""
    assert fmt.dtype is not None
    c = x.to(fmt.dtype).to(torch.float32)
    out = torch.full(x.shape, Col.NORMAL, dtype=torch.int64)
    finite = torch.isfinite(x)
    if fmt.saturates:
        # torch's E4M3FN cast clamps to ±max; ampdoctor calls overflow what a round-to-nearest-even
        # cast without the clamp would take beyond max (computed here independently, in float64)
        assert bool((c[finite & (x.abs() >= fmt.max)].abs() == fmt.max).all())
        over = finite & (rne(x, fmt.mantissa_bits).abs() > fmt.max)
    else:
        over = finite & torch.isinf(c)
    out[finite & (c != 0) & (c.abs() < fmt.min_normal)] = Col.SUBNORMAL
    out[finite & (c == 0) & (x != 0)] = Col.UNDERFLOW
    out[x == 0] = Col.ZERO
    out[over] = Col.OVERFLOW
    out[x == math.inf] = Col.POSINF
    out[x == -math.inf] = Col.NEGINF
    out[torch.isnan(x)] = Col.NAN
    return out


def rne(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """x rounded to ``mantissa_bits + 1`` significant bits, ties to even (no exponent limits), in float64."""
    a = x.double().numpy()
    m, e = np.frexp(a)  # a = m * 2**e, 0.5 <= |m| < 1; m * 2**p is exact, np.rint rounds half to even
    p = mantissa_bits + 1
    with np.errstate(invalid="ignore"):
        return torch.from_numpy(np.ldexp(np.rint(np.ldexp(m, p)), e - p))


def stats_category(x: torch.Tensor, fmt: Format, scale: float = 1.0) -> torch.Tensor:
    rows = tensor_stats([x[i : i + 1] for i in range(x.numel())], fmt, scale)
    cats = rows[:, CATS]
    assert bool((cats.sum(dim=1) == 1).all())
    return torch.tensor(CATS)[cats.argmax(dim=1)]


def edge_values(fmt: Format) -> list[float]:
    """Every threshold of the format, one float32 ulp either side, both signs."""
    pts = [fmt.max, fmt.overflow_threshold, fmt.min_normal, fmt.subnormal_threshold, fmt.min_subnormal,
           fmt.underflow_threshold, 2 * fmt.min_subnormal, 3 * fmt.underflow_threshold]
    vals = []
    for p in pts:
        p = _f32(p)
        vals += [p, _next(p, math.inf), _next(p, 0.0)]
    vals += [0.0, 1.0, math.inf, math.nan, torch.finfo(torch.float32).max]
    return vals + [-v for v in vals]


# the named edges of the issue ------------------------------------------------------------------


def test_fp16_named_edges() -> None:
    cases = {
        65504.0: Col.NORMAL, 65519.0: Col.NORMAL, _next(65520.0, 0.0): Col.NORMAL, 65520.0: Col.OVERFLOW,
        2.0**-14: Col.NORMAL, _next(2.0**-14, 0.0): Col.NORMAL,  # rounds up to 2^-14
        _next(2.0**-14 - 2.0**-25, 0.0): Col.SUBNORMAL, 2.0**-24: Col.SUBNORMAL,
        2.0**-25: Col.UNDERFLOW, _next(2.0**-25, 1.0): Col.SUBNORMAL, _next(2.0**-25, 0.0): Col.UNDERFLOW,
    }
    x = torch.tensor([*cases, *(-v for v in cases)], dtype=torch.float32)
    want = torch.tensor(list(cases.values()) * 2)
    assert torch.equal(stats_category(x, FP16), want)
    assert torch.equal(expected_category(x, FP16), want)
    assert float(torch.tensor(65519.0).half()) == 65504.0 and math.isinf(float(torch.tensor(65520.0).half()))
    assert float(torch.tensor(2.0**-25).half()) == 0.0 and float(torch.tensor(_next(2.0**-25, 1.0)).half()) == 2.0**-24


def test_bf16_named_edges() -> None:
    bmax = float(torch.finfo(torch.bfloat16).max)
    assert BF16.max == bmax and BF16.min_normal == float(torch.finfo(torch.bfloat16).tiny)
    x = torch.tensor([bmax, BF16.overflow_threshold, _next(BF16.overflow_threshold, 0.0), 2.0**-126,
                      _next(BF16.subnormal_threshold, 0.0), 2.0**-133, 2.0**-134, _next(2.0**-134, 1.0)], dtype=torch.float32)
    want = [Col.NORMAL, Col.OVERFLOW, Col.NORMAL, Col.NORMAL, Col.SUBNORMAL, Col.SUBNORMAL, Col.UNDERFLOW, Col.SUBNORMAL]
    assert stats_category(x, BF16).tolist() == want
    assert expected_category(x, BF16).tolist() == want


def test_fp8_named_edges() -> None:
    # 464 is the tie between 448 (0x7E, even) and 480: round-to-nearest-even gives 448, so it fits
    e4 = torch.tensor([448.0, 463.0, 464.0, _next(464.0, 480.0), 480.0, 2.0**-6, 2.0**-9, 2.0**-10, _next(2.0**-10, 1.0)])
    assert stats_category(e4, FP8_E4M3).tolist() == [Col.NORMAL, Col.NORMAL, Col.NORMAL, Col.OVERFLOW, Col.OVERFLOW,
                                                     Col.NORMAL, Col.SUBNORMAL, Col.UNDERFLOW, Col.SUBNORMAL]
    assert e4.to(torch.float8_e4m3fn).float()[:5].tolist() == [448.0] * 5  # torch saturates
    e5 = torch.tensor([57344.0, _next(61440.0, 0.0), 61440.0, 2.0**-14, 2.0**-16, 2.0**-17, _next(2.0**-17, 1.0)])
    want = [Col.NORMAL, Col.NORMAL, Col.OVERFLOW, Col.NORMAL, Col.SUBNORMAL, Col.UNDERFLOW, Col.SUBNORMAL]
    assert stats_category(e5, FP8_E5M2).tolist() == want
    assert expected_category(e5, FP8_E5M2).tolist() == want


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_every_edge_matches_the_cast(fmt: Format) -> None:
    x = torch.tensor(edge_values(fmt), dtype=torch.float32)
    assert torch.equal(stats_category(x, fmt), expected_category(x, fmt))


# random tensors over many binades ----------------------------------------------------------------


def spread(n: int, seed: int) -> torch.Tensor:
    """Random float32 over ~280 binades, with zeros, NaN, ±inf, and values at every format's edges."""
    g = torch.Generator().manual_seed(seed)
    e = torch.rand(n, generator=g, dtype=torch.float64) * 278 - 150
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = (sign * torch.exp2(e)).to(torch.float32)
    x[:: 97] = 0.0
    x[1:: 211] = math.nan
    x[2:: 307] = math.inf
    x[3:: 401] = -math.inf
    edges = torch.tensor([v for f in ALL for v in edge_values(f)], dtype=torch.float32)
    return torch.cat([x, edges])


def _counts(cats: torch.Tensor) -> list[int]:
    return [int((cats == c).sum()) for c in CATS]


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("scale", [1.0, 2.0**-12, 3.7, 1024.0, 65536.0])
def test_random_tensors_match_a_direct_cast(fmt: Format, scale: float) -> None:
    x = spread(40_000, seed=int(scale * 10) % 1000)
    y = x * scale  # the same float32 product tensor_stats tests
    row = tensor_stats([x], fmt, scale)[0]
    assert [int(row[c]) for c in CATS] == _counts(expected_category(y, fmt))
    fin = torch.isfinite(y)
    assert float(row[Col.ABSMAX]) == float(y[fin].abs().max())
    assert float(row[Col.MIN_NONZERO]) == float(y[fin & (y != 0)].abs().min())


def test_many_tensors_at_once_match_one_by_one() -> None:
    x = spread(5000, seed=3)
    parts = list(x.split([1, 17, 1000, 2000, 0, 2982 + len(x) - 6000]))
    together = tensor_stats(parts, FP16, 8.0)
    for i, p in enumerate(parts):
        assert torch.equal(together[i], tensor_stats([p], FP16, 8.0)[0])


# binade histogram and loss-scale windows ---------------------------------------------------------


def test_binade_histogram_counts_ceil_log2() -> None:
    x = torch.tensor([1.0, 1.5, 2.0, 0.75, 2.0**-149, 3 * 2.0**-149, 0.0, math.inf, math.nan, -4.0])
    h = binade_histogram([x])[0]
    assert h.sum() == 7  # ceil(log2|x|): 1 and 0.75 → 0; 1.5 and 2 → 1; 4 → 2; zero, inf, NaN not counted
    assert {BINADE_MIN + i: int(v) for i, v in enumerate(h.tolist()) if v} == {0: 2, 1: 2, 2: 1, -149: 1, -147: 1}
    assert h.shape == (NBINADES,)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_histogram_gives_the_underflow_of_every_power_of_two_scale(fmt: Format) -> None:
    x = spread(20_000, seed=11)
    cum = np.cumsum(binade_histogram([x])[0].numpy())
    u = round(math.log2(fmt.underflow_threshold))
    ks = range(0, 41, 4) if fmt is BF16 else range(-40, 41, 4)  # (BF16's threshold is a float32 subnormal)
    for k in ks:
        y = x * 2.0**k
        # x, not y: a product that float32 itself flushes to 0 still underflows the format
        actual = int(((y.to(fmt.dtype) == 0) & (x != 0) & torch.isfinite(x)).sum())
        e = u - k
        derived = 0 if e < BINADE_MIN else int(cum[min(e, len(cum) - 1) - BINADE_MIN])
        assert derived == actual, k


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("tol", [0.0, 0.01, 0.3])
def test_scale_window_is_tight(fmt: Format, tol: float) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-30, 5, (4000,), generator=g).float())
    row = tensor_stats([x], fmt)[0]
    lo, hi = scale_window(binade_histogram([x])[0].numpy(), float(row[Col.ABSMAX]), x.numel(), fmt, tol)

    def over(s: float) -> float:  # x * s beyond float32's max is +-inf before the cast test: count it too
        r = tensor_stats([x], fmt, s)[0]
        return float(r[Col.OVERFLOW] + r[Col.POSINF] + r[Col.NEGINF])

    def under(s: float) -> float:
        return float(tensor_stats([x], fmt, s)[0, Col.UNDERFLOW]) / x.numel()

    assert over(hi) == 0 and over(2 * hi) > 0
    assert under(lo) <= tol and under(lo / 2) > tol


def test_unknown_and_missing_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.errors import UsageError

    with pytest.raises(UsageError, match="supported: fp16, bf16, fp8_e4m3, fp8_e5m2"):
        get_format("fp12")
    assert get_format("half") is FP16 and get_format("E4M3") is FP8_E4M3
    monkeypatch.delattr(torch, "float8_e5m2")
    with pytest.raises(UsageError, match="has no float8_e5m2"):
        get_format("fp8_e5m2")
