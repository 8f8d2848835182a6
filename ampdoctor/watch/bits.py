"""The bit patterns the on-device statistics compare against: FP32's +inf and a format's cast thresholds.

float32 values of one sign order like their IEEE bit patterns, so "does |x| underflow / go subnormal / overflow
in this format" is an integer comparison of |x|'s bits with the thresholds' bits (``watch.stats``' eager path,
the fused C++ kernel, the Triton kernel of ``watch.triton_stats``).
"""

from __future__ import annotations

import struct
from functools import lru_cache

import torch

from ampdoctor.formats import Format

INF_BITS = 0x7F800000
"""FP32 +inf as int32 bits: an |x| below it is finite (the on-device kernels compare bits)."""


def _f32_bits(x: float) -> int:
    """The IEEE bit pattern of a float32 as an int (non-negative x: ordered like the values)."""
    return int(struct.unpack("<i", struct.pack("<f", x))[0])


@lru_cache(maxsize=64)
def _thresholds(fmt: Format) -> tuple[int, int, int]:
    """Bit-pattern thresholds on |x| for the cast categories (exact: float32 |x| orders like its bits)."""
    uf_next = float(torch.nextafter(torch.tensor(fmt.underflow_threshold), torch.tensor(1.0)))
    return (
        _f32_bits(uf_next),  # |x| >= this: does not underflow
        _f32_bits(fmt.subnormal_threshold),  # |x| >= this: normal
        _f32_bits(fmt.overflow_threshold),  # |x| >= this: overflows
    )


__all__ = ["INF_BITS", "_f32_bits", "_thresholds"]
