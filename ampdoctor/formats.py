"""Floating-point target formats and the exact thresholds of a round-to-nearest-even cast.

A value *overflows* in a format when casting it gives ±inf (or, for FP8 E4M3FN, which has no inf
and whose cast torch clamps to ±448, when round-to-nearest-even would take it beyond ±max); it *underflows* when it is non-zero and the cast gives 0; it is
*subnormal* when the cast result is non-zero and below the format's smallest normal.
The thresholds below are derived from the format's bit layout, not tuned: they are what
``tensor.to(dtype)`` does, and ``tests/test_formats.py`` checks them against the cast at the edges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ampdoctor.errors import UsageError


@dataclass(frozen=True)
class Format:
    """A floating-point storage format: its limits and cast thresholds."""

    name: str
    dtype_name: str
    """Attribute of ``torch`` holding the dtype (may be missing on old torch builds)."""
    mantissa_bits: int
    """Explicit fraction bits (10 for FP16, 7 for BF16)."""
    max: float
    """Largest finite value."""
    min_normal: float
    """Smallest positive normal value."""
    saturates: bool = False
    """True when the cast clamps out-of-range values to ±max instead of giving ±inf."""

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal: one ulp of the lowest binade."""
        return self.min_normal * 2.0 ** (-self.mantissa_bits)

    @property
    def max_significand_odd(self) -> bool:
        """Whether the last fraction bit of ``max`` is 1 (the parity of its bit pattern).

        FP16 65504 is 0x7BFF, BF16's max 0x7F7F, E5M2 57344 0x7B: odd. E4M3FN 448 is 0x7E (its all-ones
        pattern 0x7F is NaN): even.
        """
        e = math.floor(math.log2(self.max))
        return int(self.max * 2.0 ** (self.mantissa_bits - e)) % 2 == 1

    @property
    def overflow_tie(self) -> float:
        """max plus half an ulp at max: the point halfway between max and the next value up."""
        ulp_at_max = 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits)
        return self.max + ulp_at_max / 2

    @property
    def overflow_threshold(self) -> float:
        """Smallest float32 |x| that overflows: ``|x| >= overflow_threshold`` is the overflow test.

        A round-to-nearest-even cast sends ``overflow_tie`` to whichever neighbour has an even
        significand. When max's is odd (FP16, BF16, E5M2) the tie rounds up, past max: the tie
        overflows (FP16: 65520). When max's is even (E4M3FN's 448) the tie rounds down to max and
        only values above it overflow: the threshold is the next float32 after 464. E4M3FN has no
        inf and torch's cast clamps to ±448; overflow there means what a round-to-nearest-even cast
        would take beyond max.
        """
        tie = self.overflow_tie
        if self.max_significand_odd:
            return tie
        return float(torch.nextafter(torch.tensor(tie, dtype=torch.float32), torch.tensor(math.inf)))

    @property
    def underflow_threshold(self) -> float:
        """Largest |x| whose cast is 0: half the smallest subnormal (the tie goes to even, 0)."""
        return self.min_subnormal / 2

    @property
    def subnormal_threshold(self) -> float:
        """Smallest |x| whose cast is normal: min_normal minus half a subnormal ulp.

        min_normal has an even significand, so the tie rounds up to it.
        """
        return self.min_normal - self.min_subnormal / 2

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype, or None when this torch build lacks it."""
        return getattr(torch, self.dtype_name, None)

    def headroom_binades(self, absmax: float) -> float:
        """log2(max / absmax): how many doublings the largest value can take before overflow."""
        if absmax <= 0 or not math.isfinite(absmax):
            return math.inf if absmax == 0 else -math.inf
        return math.log2(self.max / absmax)


FP16 = Format("fp16", "float16", 10, 65504.0, 2.0**-14)
BF16 = Format("bf16", "bfloat16", 7, float(torch.finfo(torch.bfloat16).max), 2.0**-126)
FP8_E4M3 = Format("fp8_e4m3", "float8_e4m3fn", 3, 448.0, 2.0**-6, saturates=True)
FP8_E5M2 = Format("fp8_e5m2", "float8_e5m2", 2, 57344.0, 2.0**-14)

FORMATS: dict[str, Format] = {f.name: f for f in (FP16, BF16, FP8_E4M3, FP8_E5M2)}
ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}


def get_format(name: str) -> Format:
    """Look a format up by name; raise UsageError naming the supported ones."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in FORMATS:
        raise UsageError(f"unknown format {name!r}; supported: {', '.join(FORMATS)}")
    fmt = FORMATS[key]
    if fmt.dtype is None:
        raise UsageError(
            f"this torch ({torch.__version__}) has no {fmt.dtype_name}; "
            f"upgrade torch (>= 2.1) to use {fmt.name}"
        )
    return fmt
