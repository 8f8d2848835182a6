"""Scaled low-precision casts: FP8 with a per-tensor or per-row scale, and the block-scaled MXFP8 and NVFP4.

A *scaled* cast multiplies the high-precision value by a scale before the cast, so that the tensor's
largest magnitude lands near the format's max, and divides it out after the GEMM. The definitions
below are torchao 0.18's (``torchao.float8.float8_utils.amax_to_scale``,
``torchao.prototype.mx_formats.mx_tensor.to_mx`` FLOOR mode, ``nvfp4_tensor.nvfp4_quantize`` with a
per-tensor scale), written out so that ampdoctor measures them without importing torchao:

- **FP8 (torchao ``Float8Linear``)**: ``scale = fmt.max / max(amax, 1e-12)`` computed in float64, then
  float32 (rowwise recipes: one amax per row, the scale rounded down to a power of two); the value
  ``x * scale`` is clamped to ±max and cast. An element *saturates* when ``|x * scale|`` reaches the
  format's overflow threshold (the cast would leave the format; the clamp keeps it at max); it is
  *flushed* when it is non-zero and its cast is 0. A fresh dynamic scale saturates nothing: only a
  scale taken from other values (a stale or delayed amax, a shard's amax) does.
- **MXFP8**: blocks of 32 along the last dimension share a power-of-two scale (E8M0)
  ``2^(floor(log2(block amax)) - 8)`` (8: the exponent of E4M3's largest power of two, 256), elements
  ``x / scale`` clamped to ±448 and cast to E4M3.
- **NVFP4**: blocks of 16 share an E4M3 scale ``e4m3(block amax / 6 / t)`` (clamped to [2^-6, 448])
  under a per-tensor FP32 scale ``t = tensor amax / (448 * 6)``; elements ``x / t / block scale``
  clamped to ±6 and rounded to E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6).

A block's dynamic range *exceeds the format* when one of its non-zero elements flushes to 0 under the
block's scale (the block spans more binades than the element format). Saturated elements are counted on
their own: under MXFP8's FLOOR scale a block whose largest value has a significand above 1.75 saturates
it by design (448 is 1.75 x 2^8), which says nothing of the block's range. Everything is reduced on the tensor's device; the callers copy
the figures to the host once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ampdoctor.formats import FP8_E4M3, Format

AMAX_FLOOR = 1e-12
"""torchao's lower bound on amax (``float8_utils.EPS``): an all-zero tensor gets the scale max / 1e-12."""


def fp8_scale(amax: torch.Tensor, fmt: Format, round_pow2: bool = False, floor: float = AMAX_FLOOR) -> torch.Tensor:
    """The FP8 scale torchao derives from ``amax`` (float32): ``fmt.max / max(amax, floor)`` in float64,
    rounded down to a power of two for the rowwise recipes. ``floor`` 0 gives the unbounded scale
    (inf for an all-zero tensor: what a cast without an amax floor does)."""
    a = amax.to(torch.float64)
    s = (fmt.max / (a.clamp(min=floor) if floor > 0 else a)).to(torch.float32)
    if round_pow2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return s


def fp8_cast(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``x * scale`` clamped to ±max and cast to ``fmt``, back in float32 (still scaled): torchao's cast."""
    dt = fmt.dtype
    assert dt is not None
    return (x.to(torch.float32) * scale).clamp(-fmt.max, fmt.max).to(dt).to(torch.float32)


OPERAND_FIELDS = ("numel", "amax", "scale", "saturated", "flushed", "nonfinite", "sqnr_db", "rows", "worst_row",
                  "worst_row_sqnr_db", "worst_row_flushed", "min_row_amax", "rowwise_flushed")
"""The figures ``operand_stats`` returns, in order (one float64 vector, on the tensor's device)."""


def _sqnr_db(signal: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """20 log10(‖signal‖ / ‖noise‖) in float64 (+inf when the noise is 0, NaN when both are)."""
    return 20 * torch.log10(signal / noise)


def operand_stats(x: torch.Tensor, fmt: Format, rowwise: bool = False, round_pow2: bool = False,
                  floor: float = AMAX_FLOOR, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 statistics of one GEMM operand as a float64 vector in ``OPERAND_FIELDS`` order:

    element count; amax; the scale used (tensorwise: the one scale; rowwise: the smallest, the row
    with the largest amax); the shares of elements that saturate, that are non-zero and flush to 0, and
    that are NaN/Inf; the SQNR of the dequantised operand against ``x`` in dB; rows (rowwise: the number
    of rows scaled on their own, else 1); the worst row (the row with the lowest SQNR), its SQNR and
    its flushed share; the smallest row amax (the row nearest a degenerate scale); the share the rowwise
    recipe's cast would flush (what-if: E4M3, one power-of-two scale per row). ``rowwise``: one
    scale per row of the last dimension (torchao's axiswise scaling along ``dim=-1``). ``scale``: apply
    this scale instead of the operand's own (a stale scale, to measure what it would saturate)."""
    x2 = x.detach().reshape(-1, x.shape[-1]) if x.dim() > 1 else x.detach().reshape(1, -1)
    xf = x2.to(torch.float32)
    ax = xf.abs()
    row_amax = ax.amax(dim=1, keepdim=True) if rowwise else ax.amax().reshape(1, 1).expand(xf.shape[0], 1)
    s = scale if scale is not None else fp8_scale(row_amax, fmt, round_pow2, floor)
    s = s.to(torch.float32).expand(xf.shape[0], 1) if s.numel() == 1 else s.to(torch.float32).reshape(-1, 1)
    scaled = xf * s
    q = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype).to(torch.float32) if fmt.dtype is not None else scaled
    n = max(xf.numel(), 1)
    sat = (scaled.abs() >= fmt.overflow_threshold) & torch.isfinite(xf)
    flushed = (xf != 0) & (q == 0) & torch.isfinite(xf)
    nonfinite = ~torch.isfinite(xf)
    x64, deq = xf.to(torch.float64), q.to(torch.float64) / s.to(torch.float64)
    err = x64 - deq
    row_sig = torch.linalg.vector_norm(x64, dim=1)
    row_noise = torch.linalg.vector_norm(err, dim=1)
    row_db = _sqnr_db(row_sig, row_noise)
    # the worst row: the lowest SQNR (a row that is all zero has NaN, never the worst)
    ranked = torch.where(torch.isnan(row_db), torch.full_like(row_db, math.inf), row_db)
    worst = torch.argmin(ranked)
    fl_row = flushed.sum(dim=1).to(torch.float64) / max(xf.shape[1], 1)
    rs = fp8_scale(ax.amax(dim=1, keepdim=True), FP8_E4M3, True, floor)
    rq = (xf * rs).clamp(-FP8_E4M3.max, FP8_E4M3.max).to(torch.float8_e4m3fn).to(torch.float32)
    what_if = ((xf != 0) & (rq == 0) & torch.isfinite(xf)).sum().to(torch.float64) / n
    f64 = torch.float64
    return torch.stack([
        torch.tensor(float(xf.numel()), dtype=f64, device=x.device),
        ax.amax().to(f64) if xf.numel() else torch.zeros((), dtype=f64, device=x.device),
        s.min().to(f64),
        sat.sum().to(f64) / n,
        flushed.sum().to(f64) / n,
        nonfinite.sum().to(f64) / n,
        _sqnr_db(torch.linalg.vector_norm(x64), torch.linalg.vector_norm(err)),
        torch.tensor(float(xf.shape[0] if rowwise else 1), dtype=f64, device=x.device),
        worst.to(f64) if rowwise else torch.zeros((), dtype=f64, device=x.device),
        ranked[worst] if rowwise else _sqnr_db(torch.linalg.vector_norm(x64), torch.linalg.vector_norm(err)),
        fl_row[worst] if rowwise else flushed.sum().to(f64) / n,
        row_amax.min().to(f64),
        what_if,
    ])


def as_dict(vec: torch.Tensor | list[float]) -> dict[str, float]:
    """An ``operand_stats`` vector (host copy) as a dict of ``OPERAND_FIELDS``."""
    vals = vec.tolist() if isinstance(vec, torch.Tensor) else list(vec)
    return dict(zip(OPERAND_FIELDS, (float(v) for v in vals), strict=True))


@dataclass
class GemmRow:
    """One operand of one Float8Linear call at one step (``scaled.OPERAND_FIELDS`` in ``stats``)."""

    step: int
    module: str
    operand: str
    fmt: str
    rowwise: bool
    stats: dict[str, float] = field(default_factory=dict)

    def flat(self) -> dict[str, Any]:
        return {"step": self.step, "module": self.module, "operand": self.operand, "dtype": self.fmt,
                "rowwise": self.rowwise, **self.stats}


# block-scaled formats ------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: ``block`` elements along the last dimension share one scale."""

    name: str
    block: int
    elem_max: float
    """The element format's largest value (E4M3 448, E2M1 6)."""
    elem_mbits: int
    elem_min_normal: float
    elem_overflow: float
    """Where a round-to-nearest-even cast would leave the element format: E4M3 464, E2M1 7 (6 + half its ulp
    of 2, the tie going to the even 8); at or beyond it the clamp saturates the element."""


MXFP8 = BlockFormat("mxfp8", 32, 448.0, 3, 2.0**-6, FP8_E4M3.overflow_threshold)
NVFP4 = BlockFormat("nvfp4", 16, 6.0, 1, 1.0, 7.0)
BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (MXFP8, NVFP4)}

BLOCK_FIELDS = ("numel", "blocks", "blocks_exceeding", "flushed", "saturated", "zero")
"""The figures ``block_stats`` returns, in order: the counts (not shares) of elements, blocks, blocks whose
range exceeds the format, flushed and saturated elements, and elements zero before the cast."""


def round_elem(v: torch.Tensor, mbits: int, min_normal: float, max_value: float) -> torch.Tensor:
    """Round-to-nearest-even to a small float format with ``mbits`` fraction bits, smallest normal
    ``min_normal`` and largest value ``max_value`` (values beyond it clamp: a saturating cast). float32 in,
    float32 out; exact for E2M1 and for every value ``tensor.to(float8_e4m3fn)`` gives."""
    a = v.abs().clamp(max=max_value)
    e = torch.floor(torch.log2(a.clamp(min=min_normal)))
    ulp = torch.exp2(e - mbits)
    q = torch.round(a / ulp) * ulp  # torch.round: half to even; a / ulp is exact (a power-of-two divide)
    return torch.copysign(q.clamp(max=max_value), v)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as float32 rows of ``block`` elements along its last dimension (zero-padded at the end of each row)."""
    xf = x.detach().to(torch.float32)
    xf = xf.reshape(-1, xf.shape[-1]) if xf.dim() > 1 else xf.reshape(1, -1)
    pad = (-xf.shape[1]) % block
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.reshape(-1, block)


def mx_scale(block_amax: torch.Tensor) -> torch.Tensor:
    """MXFP8's E8M0 block scale (torchao FLOOR): 2^(floor(log2 amax) - 8), exponent clamped to [-127, 127]
    and the value to at least 2^-126 (float32's smallest normal)."""
    a = block_amax.to(torch.float32)
    e = torch.where(a >= 2.0**-126, torch.floor(torch.log2(a.clamp(min=2.0**-126))), torch.full_like(a, -127.0))
    return torch.exp2((e - 8).clamp(-127, 127)).clamp(min=2.0**-126)


def nvfp4_scales(b: torch.Tensor, tensor_amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-block divisor ``t * e4m3(block amax / 6 / t)`` with ``t = tensor amax / 2688`` (float32)."""
    t = tensor_amax.to(torch.float32) / (448.0 * 6.0)
    t = torch.where(t > 0, t, torch.ones_like(t))
    bs = (b.abs().amax(dim=1, keepdim=True) / 6.0) / t
    bs8 = bs.clamp(min=FP8_E4M3.min_normal, max=448.0).to(torch.float8_e4m3fn).to(torch.float32)
    return t * bs8


def block_quantize(x: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blocks, scaled, q)``: the float32 blocks of ``x``, the values divided by their block's scale, and
    those values cast to the element format (saturating)."""
    b = _blocks(x, fmt.block)
    if fmt is MXFP8:
        scaled = b / mx_scale(b.abs().amax(dim=1, keepdim=True))
        q = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    else:
        finite = b[torch.isfinite(b)]
        amax = finite.abs().amax() if finite.numel() else torch.zeros((), device=b.device)
        scaled = b * (1.0 / nvfp4_scales(b, amax))
        q = round_elem(scaled, fmt.elem_mbits, fmt.elem_min_normal, fmt.elem_max)
    return b, scaled, q


def block_stats(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The block-scaled statistics of ``x`` (float64 counts in ``BLOCK_FIELDS`` order, on its device).
    Padding added to fill a row's last block counts as zeros of no element."""
    numel = x.numel()
    b, scaled, q = block_quantize(x, fmt)
    real = torch.ones_like(b, dtype=torch.bool)
    pad = (-(x.shape[-1] if x.dim() else 1)) % fmt.block
    if pad:
        real = real.reshape(-1, (x.shape[-1] + pad))
        real[:, x.shape[-1]:] = False
        real = real.reshape(b.shape)
    fin = torch.isfinite(b) & real
    flushed = fin & (b != 0) & (q == 0)
    sat = fin & (scaled.abs() >= fmt.elem_overflow)
    exceeding = flushed.any(dim=1)
    f64 = torch.float64
    return torch.stack([
        torch.tensor(float(numel), dtype=f64, device=b.device),
        torch.tensor(float(b.shape[0]), dtype=f64, device=b.device),
        exceeding.sum().to(f64), flushed.sum().to(f64), sat.sum().to(f64), ((b == 0) & real).sum().to(f64),
    ])


def get_block_format(name: str) -> BlockFormat | None:
    """The block-scaled format of that name (``mxfp8``, ``nvfp4``), or None."""
    return BLOCK_FORMATS.get(name.strip().lower())
