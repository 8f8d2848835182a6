"""The overflow tie of every format, derived from the bits of its max, and random bit patterns against the cast.

A round-to-nearest-even cast sends the tie halfway between max and the next value up to the
neighbour whose significand is even. FP16's max 65504 is 0x7BFF (odd): 65520 rounds up, to inf.
E4M3FN's max 448 is 0x7E (even; 0x7F is NaN): 464 rounds down, to 448, and only |x| > 464 overflows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.formats import FORMATS, Format
from ampdoctor.records import Col

from .test_formats import expected_category, rne, stats_category

MAX_BITS = {"fp16": (torch.int16, 0x7BFF), "bf16": (torch.int16, 0x7F7F), "fp8_e4m3": (torch.uint8, 0x7E),
            "fp8_e5m2": (torch.uint8, 0x7B)}
"""The bit pattern of each format's largest finite value, as the format's spec gives it."""
ALL = list(FORMATS.values())


def _from_bits(fmt: Format, bits: int) -> float:
    storage, _ = MAX_BITS[fmt.name]
    assert fmt.dtype is not None
    return float(torch.tensor([bits], dtype=storage).view(fmt.dtype).float())


def _f32_next(x: float, to: float) -> float:
    return float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(to, dtype=torch.float32)))


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_the_tie_comes_from_the_bits_of_max(fmt: Format) -> None:
    _, bits = MAX_BITS[fmt.name]
    top, below = _from_bits(fmt, bits), _from_bits(fmt, bits - 1)
    assert top == fmt.max
    tie = top + (top - below) / 2  # halfway to the next value up: one ulp at max, the ulp of the binade below max's
    assert tie == fmt.overflow_tie
    odd = bool(bits & 1)
    assert fmt.max_significand_odd is odd
    # an odd max sends the tie up (it overflows); an even max keeps it, and only the next float32 up overflows
    assert fmt.overflow_threshold == (tie if odd else _f32_next(tie, math.inf))
    x = torch.tensor([_f32_next(tie, 0.0), tie, _f32_next(tie, math.inf)], dtype=torch.float32)
    want_tie = Col.OVERFLOW if odd else Col.NORMAL
    assert stats_category(x, fmt).tolist() == [Col.NORMAL, want_tie, Col.OVERFLOW]
    assert stats_category(-x, fmt).tolist() == [Col.NORMAL, want_tie, Col.OVERFLOW]
    assert rne(x, fmt.mantissa_bits).tolist()[:2] == [top, top if not odd else tie + (tie - top)]
    assert fmt.dtype is not None
    cast = x.to(fmt.dtype).float().tolist()
    if fmt.saturates:
        assert cast == [top, top, top]  # torch clamps; the tie would be top without the clamp too
    else:
        assert cast[0] == top and math.isinf(cast[2]) and (math.isinf(cast[1]) if odd else cast[1] == top)


def test_the_named_ties() -> None:
    assert FORMATS["fp16"].overflow_threshold == 65520.0  # 65504 = 0x7BFF, odd: the tie overflows
    assert FORMATS["fp8_e5m2"].overflow_threshold == 61440.0
    e4 = FORMATS["fp8_e4m3"]
    assert e4.overflow_tie == 464.0 and 464.0 < e4.overflow_threshold < 464.0001  # 448 = 0x7E, even: 464 fits


def _floats(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_random_bit_patterns_match_the_cast(bits: list[int]) -> None:
    x = _floats(bits)
    for fmt in ALL:
        assert torch.equal(stats_category(x, fmt), expected_category(x, fmt)), fmt.name


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(ALL), st.lists(st.tuples(st.integers(-4096, 4096), st.booleans()), min_size=1, max_size=64))
def test_bit_patterns_around_the_overflow_tie_match_the_cast(fmt: Format, offsets: list[tuple[int, bool]]) -> None:
    base = int(np.array([fmt.overflow_tie], dtype=np.float32).view(np.uint32)[0])
    x = _floats([(base + d) | (0x80000000 if neg else 0) for d, neg in offsets])
    assert torch.equal(stats_category(x, fmt), expected_category(x, fmt))
