"""Tensor statistics for a target format, computed on the device for many tensors at once.

Every tensor is summarised by one row of ``NCOLS`` numbers (see ``Col``). Small tensors are
concatenated and reduced together with segment ids, so a step costs a fixed number of kernels
however many tensors it has; large tensors are reduced one by one (their launch cost is
negligible next to their size). Nothing here synchronises with the host: ``StatsBuffer.collect``
returns one device tensor, which the caller copies to the host once a step.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from ampdoctor.formats import FP16, Format
from ampdoctor.records import BINADE_MIN, NBINADES, NCOLS, Col
from ampdoctor.watch import fused
from ampdoctor.watch.bits import INF_BITS, _f32_bits, _thresholds
from ampdoctor.watch.fused import fused_stats

_NCAT = 10  # bucket categories before folding signs, see _boundaries


_NEG_INF_BITS = -8388608  # 0xFF800000 as int32
_INT_MAX = 0x7FFFFFFF


@lru_cache(maxsize=32)
def _segments(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """8 x segment index of every element of the concatenated tensors (cached: sizes repeat every step)."""
    n = len(sizes)
    counts = torch.tensor(sizes, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(n, dtype=torch.int32) * 8, counts).to(device)


@lru_cache(maxsize=64)
def _bounds(fmt: Format, device: torch.device) -> torch.Tensor:
    uf, sub, of = _thresholds(fmt)
    return torch.tensor([1, uf, sub, of, INF_BITS, INF_BITS + 1], dtype=torch.int32, device=device)


def tensor_stats(tensors: list[torch.Tensor], fmt: Format = FP16, scale: float = 1.0) -> torch.Tensor:
    """Stats rows ``[len(tensors), NCOLS]`` (float64, on the tensors' device).

    ``scale`` multiplies every value before the cast test (what a loss scale does to gradients).

    The categories come from the float32 bit patterns: for non-negative floats the integer order
    of the bits is the order of the values, so "x overflows" is an integer comparison against the
    bits of the threshold, exactly, and NaN (bits above +inf's) needs no separate test. Category per
    element (0 zero, 1 underflow, 2 subnormal, 3 normal, 4 overflow, 5 +inf, 6 NaN, 7 -inf), plus
    8 x segment, then one bincount for every tensor at once.
    """
    if not tensors:
        return torch.zeros((0, NCOLS), dtype=torch.float64)
    if scale == 1.0 and tensors[0].device.type == "cpu":
        rows = fused_stats(tensors, *_thresholds(fmt))  # one pass, when the kernel is built (see watch.fused)
        if rows is not None:
            return rows
    elif tensors[0].device.type == "cuda":
        from ampdoctor.watch.triton_stats import triton_stats

        rows = triton_stats(tensors, fmt, scale)  # one launch, where Triton is installed (see watch.triton_stats)
        if rows is not None:
            return rows
    return eager_stats(tensors, fmt, scale)


def scaled_stats(tensors: list[torch.Tensor], fmt: Format, scale: float) -> torch.Tensor:
    """``tensor_stats(tensors, fmt, scale)`` for gradients that still carry a loss scale (``scale`` = 1 / the
    loss scale), in the kernel's one pass where it can: for ``scale = 2^-k`` it moves the thresholds instead
    of multiplying (|x * s| >= t  <=>  |x| >= t / s). The rows are the exact rows of ``x * s`` for every
    product in FP32's normal range; a product below it (|x * s| < 2^-126, far under any format's smallest
    subnormal: an underflow either way) keeps its unrounded value, so it may count as an underflow where
    the multiplication would have rounded it to a zero, and the smallest non-zero column is its exact value."""
    if tensors and tensors[0].device.type == "cpu" and _pow2(scale) and scale < 1.0:
        moved = _thresholds_scaled(fmt, scale)  # (above 1 a product can overflow FP32: the eager path multiplies)
        rows = fused_stats(tensors, *moved) if moved is not None else None
        if rows is not None:
            rows[:, Col.ABSMAX] *= scale
            rows[:, Col.MIN_NONZERO] *= scale
            return rows
    return tensor_stats(tensors, fmt, scale)


def _pow2(x: float) -> bool:
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


@lru_cache(maxsize=64)
def _thresholds_scaled(fmt: Format, scale: float) -> tuple[int, int, int] | None:
    """``_thresholds`` for values multiplied by ``scale`` (a power of two below 1) before the cast test, or None where
    a moved threshold is not a normal float32 (the eager path multiplies then). Exact but for products below
    FP32's smallest subnormal (a value the multiplication would round to 0 counts as an underflow, not a zero)."""
    out = []
    for t in _thresholds(fmt):
        v = _bits_f32(t) / scale
        if v > _F32_MAX:
            out.append(INF_BITS)  # no finite value reaches it: nothing overflows (as x * s cannot)
        elif v < _F32_MIN_NORMAL:
            return None
        else:
            out.append(_f32_bits(v))
    return (out[0], out[1], out[2])


_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_MIN_NORMAL = float(torch.finfo(torch.float32).tiny)


def _bits_f32(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<i", bits))[0])


def eager_stats(tensors: list[torch.Tensor], fmt: Format = FP16, scale: float = 1.0) -> torch.Tensor:
    """``tensor_stats`` in eager PyTorch (every device; the rows the fused kernel must equal)."""
    if not tensors:
        return torch.zeros((0, NCOLS), dtype=torch.float64)
    device = tensors[0].device
    sizes = tuple(t.numel() for t in tensors)
    n = len(sizes)
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1) for t in tensors]) if n > 1 else tensors[0].reshape(-1)
        if fmt is FP16 and scale == 1.0 and flat.dtype in (torch.float32, torch.float16):
            return _fp16_stats(flat, sizes)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        if scale != 1.0:  # the cast test applies to the float32 product, as GradScaler computes it
            flat = flat * scale
        bits = flat.view(torch.int32)
        ai = bits & _INT_MAX
        cat = torch.bucketize(ai, _bounds(fmt, device), right=True, out_int32=True)
        cat.add_(bits == _NEG_INF_BITS, alpha=2)  # -inf: 5 -> 7
        finite = torch.where(ai < INF_BITS, ai, 0).view(torch.float32)  # |x|, 0 where not finite
        nonzero = torch.where(finite > 0, finite, float("inf"))
        if n == 1:
            counts = torch.bincount(cat, minlength=8)[None, :8]
            absmax = finite.amax().reshape(1) if finite.numel() else torch.zeros(1, device=device)
            minnz = nonzero.amin().reshape(1) if nonzero.numel() else torch.full((1,), float("inf"), device=device)
        else:
            counts = torch.bincount(cat.add_(_segments(sizes, device)), minlength=n * 8).view(n, 8)
            live = [i for i, k in enumerate(sizes) if k]
            absmax = torch.zeros(n, device=device)
            minnz = torch.full((n,), float("inf"), device=device)
            if live:
                fin_parts = finite.split(sizes)
                nz_parts = nonzero.split(sizes)
                amax = torch.stack(torch._foreach_max([fin_parts[i] for i in live]))
                amin = torch.stack(torch._foreach_max(torch._foreach_neg([nz_parts[i] for i in live])))
                if len(live) == n:
                    absmax, minnz = amax, -amin
                else:
                    where = torch.tensor(live, device=device)
                    absmax[where] = amax
                    minnz[where] = -amin
        c = counts.to(torch.float64)
        numel = c.sum(dim=1, keepdim=True)
        # columns: NUMEL ZERO UNDERFLOW SUBNORMAL NORMAL OVERFLOW POSINF NEGINF NAN ABSMAX MIN_NONZERO
        return torch.cat([numel, c[:, 0:6], c[:, 7:8], c[:, 6:7], absmax.double()[:, None], minnz.double()[:, None]], dim=1)


def _fp16_stats(flat: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """The FP16 fast path: categories read from the cast itself.

    ``flat.half()`` *is* the cast the definitions refer to, and it is one fast vectorised pass.
    Its bit pattern says zero / subnormal / normal / inf / NaN; comparing with the source says
    which zeros were underflows and which infs were overflows. One bincount over
    key + 20 x segment gives every count of every tensor. An FP16 source is read as is: it can
    no longer underflow or overflow, and all its arithmetic runs on 16-bit integers.
    """
    n = len(sizes)
    device = flat.device
    half_in = flat.dtype == torch.float16
    hb = (flat if half_in else flat.to(torch.float16)).view(torch.int16)
    h = hb & 0x7FFF
    # fp16 class: 0 zero, 1 subnormal, 2 normal, 3 inf, 4 NaN
    key = (h > 0).to(torch.uint8)
    key += h >= 0x0400
    key += h >= 0x7C00
    key += h > 0x7C00
    if half_in:
        key.add_(hb == -1024, alpha=15)  # 0xFC00: -inf, 3 -> 18
    else:
        key.add_(flat == 0, alpha=5)  # a true zero: 0 -> 5 (a zero class without it is an underflow)
        isinf = key == 3
        key.add_(isinf & (flat == float("inf")), alpha=10)  # 3 -> 13
        key.add_(isinf & (flat == float("-inf")), alpha=15)  # 3 -> 18; a class-3 left is an overflow
    # |x| as ordered integer bits with non-finite values at 0: max is the finite absmax
    if half_in:
        fin = torch.where(h < 0x7C00, h, 0)
        absmax_bits, minnz_bits = _segment_max_min_bits(fin, sizes, device, 0x7C00)
        absmax = absmax_bits.view(torch.float16).float() if absmax_bits.dtype == torch.int16 else absmax_bits
        minnz = minnz_bits.view(torch.float16).float() if minnz_bits.dtype == torch.int16 else minnz_bits
    else:
        ai = flat.view(torch.int32) & _INT_MAX
        fin = torch.where(ai < INF_BITS, ai, 0)
        absmax_bits, minnz_bits = _segment_max_min_bits(fin, sizes, device, INF_BITS)
        absmax = absmax_bits.view(torch.float32)
        minnz = minnz_bits.view(torch.float32)
    if n == 1:
        counts = torch.bincount(key.to(torch.int32), minlength=20)[None, :20]
    else:
        counts = torch.bincount(key.to(torch.int32).add_(_segments20(sizes, device)), minlength=n * 20).view(n, 20)
    c = counts.to(torch.float64)
    numel = c.sum(dim=1, keepdim=True)
    nan = c[:, 4:5] + c[:, 9:10] + c[:, 14:15] + c[:, 19:20]
    zero = torch.zeros_like(numel)
    if half_in:  # key 0 zero, 1 subnormal, 2 normal, 3 +inf, 18 -inf, 4 NaN
        cols = [numel, c[:, 0:1], zero, c[:, 1:2], c[:, 2:3], zero, c[:, 3:4], c[:, 18:19], nan]
    else:  # key 5 zero, 0 underflow, 1 subnormal, 2 normal, 3 overflow, 13 +inf, 18 -inf, 4 NaN
        cols = [numel, c[:, 5:6], c[:, 0:1], c[:, 1:2], c[:, 2:3], c[:, 3:4], c[:, 13:14], c[:, 18:19], nan]
    return torch.cat([*cols, absmax.double()[:, None], minnz.double()[:, None]], dim=1)


def _segment_max_min_bits(fin: torch.Tensor, sizes: tuple[int, ...], device: torch.device,
                          none: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment: max of ``fin`` (|x| bits, 0 where not finite) and min of its non-zero entries
    (``none``, the bits of +inf, when a segment has none). Integer bits of non-negative floats order
    like the values, so no float conversion is needed."""
    n = len(sizes)
    # non-zero minimum as a maximum: -(bits) where non-zero, -none elsewhere
    neg = fin.masked_fill(fin == 0, none).neg_()
    if n > 1 and fin.numel() <= SMALL_NUMEL:
        # small batches: two scatter reductions beat a launch per tensor
        idx = _segment_index(sizes, device)
        absmax = torch.zeros(n, dtype=fin.dtype, device=device).scatter_reduce_(0, idx, fin, "amax")
        minnz = torch.full((n,), -none, dtype=fin.dtype, device=device).scatter_reduce_(0, idx, neg, "amax").neg_()
        return absmax, minnz
    if n == 1:
        return fin.amax().reshape(1) if fin.numel() else torch.zeros(1, dtype=fin.dtype, device=device), \
            (-neg.amax()).reshape(1) if neg.numel() else torch.full((1,), none, dtype=fin.dtype, device=device)
    live = [i for i, k in enumerate(sizes) if k]
    absmax = torch.zeros(n, dtype=fin.dtype, device=device)
    minnz = torch.full((n,), none, dtype=fin.dtype, device=device)
    if not live:
        return absmax, minnz
    fparts = fin.split(sizes)
    nparts = neg.split(sizes)
    both = torch._foreach_max([fparts[i] for i in live] + [nparts[i] for i in live])
    k = len(live)
    amax = torch.stack(both[:k])
    amin = -torch.stack(both[k:])
    if k == n:
        return amax, amin
    where = torch.tensor(live, device=device)
    absmax[where] = amax
    minnz[where] = amin
    return absmax, minnz


SMALL_NUMEL = 1 << 16
"""Batches up to this many elements take the few-kernel path (launch cost dominates there)."""


@lru_cache(maxsize=32)
def _segment_index(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Segment index (int64) of every element of the concatenated tensors (cached)."""
    counts = torch.tensor(sizes, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int64), counts).to(device)


@lru_cache(maxsize=32)
def _segments20(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """20 x segment index of every element (int32; cached, sizes repeat every step)."""
    counts = torch.tensor(sizes, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32) * 20, counts).to(device)


@dataclass
class _Pending:
    keys: list[Hashable]
    tensors: list[torch.Tensor]
    numel: int = 0


class StatsBuffer:
    """Collects tensors during a step and reduces them in batches, on their device.

    ``add`` only keeps a reference (no kernel, no sync) until ``flush_numel`` elements are
    pending; then the batch is reduced and the reference dropped, which bounds the extra memory.
    """

    def __init__(self, fmt: Format = FP16, flush_numel: int = 1 << 22, big_numel: int = 1 << 20,
                 split_numel: int = 1 << 18):
        self.fmt = fmt
        self.split_numel = split_numel
        self.flush_numel = flush_numel
        self.big_numel = big_numel
        self._pending: dict[torch.device, _Pending] = {}
        self._keys: list[Hashable] = []
        self._rows: list[torch.Tensor] = []

    def add(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Queue a tensor under ``key``; ``collect`` returns its row aligned with the key.

        Hot path (called for every watched tensor): a reference is kept, nothing is computed;
        the reduction runs under no_grad, so the tensor need not be detached here.
        """
        numel = tensor.numel()
        if numel >= self.big_numel:
            self._keys.append(key)
            self._rows.append(tensor_stats([tensor], self.fmt))
            return
        self._enqueue(tensor.device, (key,), (tensor,), numel)

    def add_many(self, keys: list[Hashable], tensors: list[torch.Tensor], numel: int, mixed: bool = False) -> None:
        """``add`` for each pair; ``numel`` is their total, ``mixed`` whether they are on more than one device."""
        if mixed or numel >= self.big_numel:
            for k, t in zip(keys, tensors, strict=True):
                self.add(k, t)
            return
        self._enqueue(tensors[0].device, keys, tensors, numel)

    def _enqueue(self, device: torch.device, keys: Sequence[Hashable], tensors: Sequence[torch.Tensor], numel: int) -> None:
        p = self._pending.get(device)
        if p is None:
            p = self._pending[device] = _Pending([], [])
        p.keys.extend(keys)
        p.tensors.extend(tensors)
        p.numel += numel
        if p.numel >= self.flush_numel:
            self._flush(device)

    def add_rows(self, keys: list[Hashable], rows: torch.Tensor) -> None:
        """Rows already reduced (``[len(keys), NCOLS]`` float64): the C++ tap's, made as each tensor appeared."""
        self._keys.extend(keys)
        self._rows.append(rows)

    def _flush(self, device: torch.device) -> None:
        p = self._pending.pop(device, None)
        if p is None or not p.tensors:
            return
        # the CPU kernel reads every dtype as it is (no conversion): one call for the whole batch
        one = p.numel < self.split_numel or (device.type == "cpu" and fused.kernel() is not None)
        dtypes = {t.dtype for t in p.tensors} if not one else set()
        if one or len(dtypes) == 1:
            # small batches: one reduction (fixed kernel cost dominates; mixed dtypes promote to float32)
            self._keys.extend(p.keys)
            self._rows.append(tensor_stats(p.tensors, self.fmt))
            return
        for dtype in dtypes:  # large batches: one per dtype, so FP16 tensors are read as FP16, not converted
            idx = [i for i, t in enumerate(p.tensors) if t.dtype == dtype]  # ints: nothing for the cyclic GC to track
            self._keys.extend([p.keys[i] for i in idx])
            self._rows.append(tensor_stats([p.tensors[i] for i in idx], self.fmt))

    def __len__(self) -> int:
        return len(self._keys) + sum(len(p.keys) for p in self._pending.values())

    def collect(self) -> tuple[list[Hashable], torch.Tensor]:
        """Reduce what is pending and return (keys, rows) with rows still on the device."""
        for device in list(self._pending):
            self._flush(device)
        keys, rows = self._keys, self._rows
        self._keys, self._rows = [], []
        if not rows:
            return keys, torch.zeros((0, NCOLS), dtype=torch.float64)
        devices = {r.device for r in rows}
        if len(devices) > 1:  # a model split over devices: bring rows together, still no sync
            target = rows[0].device
            rows = [r.to(target, non_blocking=True) for r in rows]
        return keys, torch.cat(rows)


# Binade histograms (added for `ampdoctor layers`) -------------------------------------------------



def binade_histogram(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, how many finite non-zero elements have ``ceil(log2|x|) == e``: ``[n, NBINADES]`` float64.

    Column ``e - BINADE_MIN`` counts the elements with ``2^(e-1) < |x| <= 2^e``. Every format's
    underflow threshold is a power of two (half its smallest subnormal), and multiplying by a
    power-of-two scale is exact, so ``|x| * 2^k <= 2^u`` exactly when ``ceil(log2|x|) <= u - k``:
    the underflow count at every power-of-two scale and every format is a prefix sum of this row.
    Values are taken as float32 (as in ``tensor_stats``); zeros, NaN and ±inf are not counted.
    Computed on the tensors' device with a fixed number of kernels; no host synchronisation.
    """
    if not tensors:
        return torch.zeros((0, NBINADES), dtype=torch.float64)
    device = tensors[0].device
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
    n = len(tensors)
    seg = torch.repeat_interleave(
        torch.arange(n, device=device), torch.tensor(sizes, device=device), output_size=flat.numel()
    )
    mant, expo = torch.frexp(flat)  # |x| = |mant| * 2^expo with |mant| in [0.5, 1)
    ceil_log2 = expo.to(torch.int64) - (mant.abs() == 0.5).to(torch.int64)  # exact powers of two: one lower
    counted = torch.isfinite(flat) & (flat != 0)
    # uncounted elements go to a spare bin per tensor, dropped below
    idx = torch.where(counted, ceil_log2 - BINADE_MIN, torch.full_like(ceil_log2, NBINADES))
    counts = torch.bincount(seg * (NBINADES + 1) + idx, minlength=n * (NBINADES + 1))
    return counts.view(n, NBINADES + 1)[:, :NBINADES].to(torch.float64)
