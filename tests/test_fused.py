"""The one-pass C++ statistics kernel gives exactly the eager rows (which tests/test_stats_props.py pins
to the real cast), over random float32 bit patterns, for every format and input dtype."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.formats import BF16, FP8_E4M3, FP8_E5M2, FP16
from ampdoctor.watch import fused
from ampdoctor.watch.stats import _thresholds, eager_stats, scaled_stats, tensor_stats

from .test_stats_props import as_f32, bit_patterns

FORMATS = [FP16, BF16, FP8_E4M3, FP8_E5M2]


@pytest.fixture(scope="module", autouse=True)
def _kernel() -> None:
    if fused.build_locked(wait=True) != 0:  # a finished build loads; one builder per machine (xdist workers)
        pytest.skip("no C++ compiler / ninja here: the fused kernel cannot be built (the eager path is used)")


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float64
    assert torch.equal(a, b), (a, b)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fused_equals_eager_on_random_bits(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(FORMATS))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    sizes = data.draw(st.lists(st.integers(0, 64), min_size=1, max_size=6))
    ts = []
    for n in sizes:
        bits = data.draw(st.lists(bit_patterns(fmt), min_size=n, max_size=n))
        t = torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy())
        ts.append(t.to(dtype))
    got = fused.fused_stats(ts, *_thresholds(fmt))
    assert got is not None
    _same(got, eager_stats(ts, fmt))


def test_fused_on_tensors_larger_than_a_chunk_and_views() -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.randint(-2**31, 2**31 - 1, (3 * fused.CHUNK + 17,), generator=g, dtype=torch.int64).to(torch.int32)
    ts = [big.view(torch.float32), torch.randn(40, 30, generator=g).t(), torch.empty(0), torch.randn(5, generator=g).half()]
    for fmt in FORMATS:
        _same(fused.fused_stats(ts, *_thresholds(fmt)), eager_stats([t.contiguous() for t in ts], fmt))  # type: ignore[arg-type]


def test_tensor_stats_uses_it_on_the_cpu_and_not_with_a_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = fused.fused_stats

    def spy(ts: list[torch.Tensor], *a: int) -> torch.Tensor | None:
        calls.append(len(ts))
        return real(ts, *a)

    monkeypatch.setattr("ampdoctor.watch.stats.fused_stats", spy)
    x = [torch.randn(10), torch.randn(3)]
    _same(tensor_stats(x, FP16), eager_stats(x, FP16))
    tensor_stats(x, FP16, scale=1024.0)  # a loss scale multiplies first: the eager path
    assert calls == [2]
    _same(scaled_stats(x, FP16, 2.0**-10), eager_stats(x, FP16, scale=2.0**-10))  # gradients still scaled: the kernel
    assert calls == [2, 2]
    monkeypatch.setenv("AMPDOCTOR_FUSED", "0")
    assert real(x, *_thresholds(FP16)) is None  # turned off: tensor_stats takes the eager path
    _same(tensor_stats(x, FP16), eager_stats(x, FP16))


def test_every_fp16_and_bf16_bit_pattern() -> None:
    """All 65,536 patterns of each 16-bit type, in one tensor and in odd-sized pieces: FP16 is widened 8 at a
    time by the CPU's conversion instruction where it has one, then one at a time for the tail."""
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        x = every.view(dtype)
        pieces = list(x.split(4093))
        for fmt in FORMATS:
            _same(fused.fused_stats([x], *_thresholds(fmt)), eager_stats([x], fmt))  # type: ignore[arg-type]
            _same(fused.fused_stats(pieces, *_thresholds(fmt)), eager_stats(pieces, fmt))  # type: ignore[arg-type]


def test_another_dtype_is_left_to_the_eager_path() -> None:
    assert fused.fused_stats([torch.randn(4), torch.zeros(3, dtype=torch.float64)], *_thresholds(FP16)) is None
    assert fused.fused_stats([torch.zeros(3, dtype=torch.int32)], *_thresholds(FP16)) is None


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_norms_are_the_float64_norms_and_nonfinite_exactly_when_an_element_is(data: st.DataObject) -> None:
    """The recipe's per-parameter gradient norms on the CPU: the float64 norm rounded to float32, so finite for
    any finite tensor whose norm fits float32 (``_foreach_norm`` in float32 overflows from |x| = 1.8e19)."""
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    sizes = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
    ts = []
    for n in sizes:
        bits = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
        ts.append(torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy()).to(dtype))
    got = fused.fused_norms(ts)
    assert got is not None and got.dtype == torch.float32 and got.shape == (len(ts),)
    ref = torch.stack([torch.linalg.vector_norm(t.double()) if t.numel() else torch.zeros((), dtype=torch.float64)
                       for t in ts])
    for g, r, t in zip(got.tolist(), ref.tolist(), ts, strict=True):
        if not torch.isfinite(t).all():
            assert not np.isfinite(g)  # NaN or Inf in: never a finite norm
        elif r <= 3.4e38:
            assert np.isfinite(g) and g == pytest.approx(r, rel=1e-6)  # (float32 rounding of the float64 norm)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rows_with_norms_are_the_rows_and_the_norms_of_separate_calls(data: st.DataObject) -> None:
    """One read for both (the recipe's gradients on a recorded step): bit for bit what each call gives alone,
    across chunk boundaries too."""
    fmt = data.draw(st.sampled_from(FORMATS))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    sizes = data.draw(st.lists(st.sampled_from([0, 1, 7, 40, fused.CHUNK - 1, fused.CHUNK + 3]), min_size=1, max_size=5))
    ts = []
    for n in sizes:
        k = min(n, 40)  # drawn bits, tiled over a larger tensor
        bits = data.draw(st.lists(bit_patterns(fmt), min_size=k, max_size=k))
        base = np.array(bits or [0], dtype=np.uint32)
        ts.append(torch.from_numpy(np.resize(base, n).view(np.float32).copy()).to(dtype))
    got = fused.fused_stats_norms(ts, *_thresholds(fmt))
    assert got is not None
    rows, norms = got
    _same(rows, fused.fused_stats(ts, *_thresholds(fmt)))
    alone = fused.fused_norms(ts)
    assert norms.dtype == torch.float32 and torch.equal(norms.view(torch.int32), alone.view(torch.int32))  # (NaN too)
    assert fused.fused_stats_norms([torch.zeros(2, dtype=torch.float64)], *_thresholds(fmt)) is None


def test_norms_match_foreach_norm_on_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(64, 64, generator=g), torch.randn(64, generator=g) * 1e-3, torch.randn(3 * fused.CHUNK + 5, generator=g)]
    got = fused.fused_norms(ts)
    want = torch.stack(torch._foreach_norm(ts, 2.0, dtype=torch.float32))
    assert got is not None and torch.allclose(got, want, rtol=1e-5, atol=0)
    assert fused.fused_norms([torch.zeros(2, dtype=torch.float64)]) is None  # another dtype: _foreach_norm


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_adam_figures_match_the_torch_passes(data: st.DataObject) -> None:
    """The ring's Adam figures in one C++ pass: the norm of m / (sqrt(v) + eps) and min(v) per state tensor, as
    the torch path (``engine.ring.adam_figures``) gives them, NaN where v holds one; float32 element arithmetic
    in both, so they agree to float32 summation order."""
    from ampdoctor.engine.ring import adam_chunks, adam_figures

    sizes = data.draw(st.lists(st.integers(1, 700), min_size=1, max_size=5))
    groups = [data.draw(st.integers(0, 1)) for _ in sizes]
    eps_g = [1e-8, data.draw(st.sampled_from([1e-6, 1e-3, 0.0]))]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    ms, vs = [], []
    for n in sizes:
        m = torch.randn(n, generator=g) * 10.0 ** data.draw(st.integers(-6, 3))
        v = (torch.randn(n, generator=g) * 10.0 ** data.draw(st.integers(-12, 2))) ** 2
        if data.draw(st.booleans()):
            v[data.draw(st.integers(0, n - 1))] = 0.0
        if data.draw(st.integers(0, 5)) == 0:
            v[data.draw(st.integers(0, n - 1))] = math.nan
        ms.append(m)
        vs.append(v)
    got = fused.fused_adam(ms, vs, [eps_g[k] for k in groups])
    assert got is not None and got.dtype == torch.float64 and got.shape == (2 * len(sizes),)
    un, lo = adam_figures(len(ms), adam_chunks(ms, vs, groups, torch.device("cpu")), eps_g, torch.device("cpu"))
    k = len(ms)
    for a, b in zip(got[:k].tolist(), un.tolist(), strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5), (a, b)
    for a, b in zip(got[k:].tolist(), lo.tolist(), strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == b, (a, b)


def test_adam_figures_leave_other_dtypes_to_torch() -> None:
    m, v = torch.zeros(3, dtype=torch.float16), torch.ones(3, dtype=torch.float16)
    assert fused.fused_adam([m], [v], [1e-8]) is None
    assert fused.fused_adam([torch.zeros(3)], [torch.ones(4)], [1e-8]) is None


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fused_with_a_power_of_two_scale_equals_eager(data: st.DataObject) -> None:
    """Gradients still carrying GradScaler's scale (a loop's ``after_backward`` before ``unscale_``): the
    kernel moves its thresholds instead of multiplying, and must give the rows ``x * 2^-k`` would."""
    fmt = data.draw(st.sampled_from(FORMATS))
    k = data.draw(st.integers(-24, 4))  # (above 1 the eager path multiplies: its product can overflow float32)
    scale = 2.0 ** k
    sizes = data.draw(st.lists(st.integers(0, 48), min_size=1, max_size=5))
    ts = []
    for n in sizes:
        bits = data.draw(st.lists(bit_patterns(fmt), min_size=n, max_size=n))
        t = torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy())
        # (products below FP32's normal range round in the multiplication: the one documented difference)
        t = torch.where((t.abs() * scale < 2.0 ** -126) & (t != 0), torch.zeros_like(t), t)
        ts.append(t)
    _same(scaled_stats(ts, fmt, scale), eager_stats(ts, fmt, scale))


def test_the_kernel_is_built_from_its_shipped_source() -> None:
    import fnmatch
    from pathlib import Path

    import tomllib

    import ampdoctor

    assert fused.SOURCE.is_file() and fused.SOURCE.parent.name == "csrc"
    data = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    shipped = data["tool"]["setuptools"]["package-data"]["ampdoctor"]
    inside = fused.SOURCE.relative_to(Path(ampdoctor.__file__).parent).as_posix()
    assert any(fnmatch.fnmatch(inside, pattern) for pattern in shipped), (inside, shipped)  # a wheel carries it
    mod = fused.kernel()
    if mod is not None:  # built (here, or by an earlier test): what the recorder and the statistics call
        assert all(callable(getattr(mod, name, None)) for name in ("stats", "norms", "Tap", "tap_call", "tap_take_acts"))


def _normal_bits(fmt: object, n: int, g: torch.Generator) -> torch.Tensor:
    """n float32 values that are normal numbers of ``fmt`` (both signs), from its smallest normal up to its max."""
    lo, hi = fmt.min_normal, fmt.max  # type: ignore[attr-defined]
    e = torch.rand(n, generator=g, dtype=torch.float64) * (math.log2(hi) - math.log2(lo)) + math.log2(lo)
    v = torch.exp2(e).clamp(lo, hi).to(torch.float32)
    v = torch.where(v < lo, torch.nextafter(v, torch.tensor(math.inf)), v)  # (rounding to float32 may cross an edge)
    v = torch.where(v > hi, torch.nextafter(v, torch.tensor(0.0)), v)
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return v * sign


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_blocks_of_normal_numbers_with_any_element_planted(data: st.DataObject) -> None:
    """Long tensors of the format's normal numbers, the case the kernel screens with only a min and a max per block,
    with elements of every other category (and threshold edges) planted anywhere, block edges included: still
    exactly the eager rows, with and without a scale, for every input dtype."""
    fmt = data.draw(st.sampled_from(FORMATS))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    n = data.draw(st.sampled_from([1023, 1024, 1025, 2048, 4097, 5000]))
    t = _normal_bits(fmt, n, g)
    for _ in range(data.draw(st.integers(0, 4))):
        at = data.draw(st.sampled_from([0, 1023, 1024, 2047, 4095, 4096, n - 1]).filter(lambda i: i < n))
        t[at] = as_f32([data.draw(bit_patterns(fmt))])[0]
    t = t.to(dtype)
    _same(fused.fused_stats([t, t[1:]], *_thresholds(fmt)), eager_stats([t, t[1:].contiguous()], fmt))
    k = data.draw(st.integers(-24, 0))
    s = t.float()
    s = torch.where((s.abs() * 2.0**k < 2.0 ** -126) & (s != 0), torch.zeros_like(s), s)
    _same(scaled_stats([s], fmt, 2.0**k), eager_stats([s], fmt, 2.0**k))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fp16_read_in_its_own_bits_equals_its_float32_widening_for_any_thresholds(data: st.DataObject) -> None:
    """The kernel reads FP16 in 16-bit lanes with the thresholds mapped to FP16 bit patterns (no widening): for any
    thresholds up to +inf, also ones no format has, above FP16's range or between two FP16 values, the rows are
    those of the same values widened to float32 and read in 32-bit lanes. Every FP16 pattern, shuffled, in pieces
    that cross the 4,096-element blocks."""
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x = every[torch.randperm(every.numel(), generator=g)]
    # (a threshold above +inf's bits would tell NaN payloads apart, which two widenings need not agree on: none is
    # used, and the kernel widens for one)
    special = [0, 1, 0x33800000, 0x38800000, 0x477FF000, 0x477FE000, 0x7F7FFFFF, 0x7F800000]
    thr = st.one_of(st.sampled_from(special), st.integers(0, 0x7F800000))
    uf, sub, of = sorted(data.draw(st.tuples(thr, thr, thr)))
    cut = data.draw(st.lists(st.integers(1, 9000), min_size=1, max_size=6))
    pieces, at = [], 0
    for n in cut:
        pieces.append(x[at: at + n])
        at += n
    pieces.append(x[at:])
    for ts in ([x], pieces):
        _same(fused.fused_stats(ts, uf, sub, of), fused.fused_stats([t.float() for t in ts], uf, sub, of))  # type: ignore[arg-type]
    normal = _normal_bits(FP16, 5000, g).half()  # (the screen's own case: blocks of normal numbers only)
    _same(fused.fused_stats([normal], uf, sub, of), fused.fused_stats([normal.float()], uf, sub, of))  # type: ignore[arg-type]
