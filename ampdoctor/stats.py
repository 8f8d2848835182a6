"""Tensor statistics for a target format, computed on the device for many tensors at once.

Every tensor is summarised by one row of ``NCOLS`` numbers (see ``Col``). Small tensors are
concatenated and reduced together with segment ids, so a step costs a fixed number of kernels
however many tensors it has; large tensors are reduced one by one (their launch cost is
negligible next to their size). Nothing here synchronises with the host: ``StatsBuffer.collect``
returns one device tensor, which the caller copies to the host once a step.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ampdoctor.formats import FP16, Format


class Col:
    """Column indices of a stats row."""

    NUMEL = 0
    ZERO = 1
    """Exactly zero already."""
    UNDERFLOW = 2
    """Non-zero, casts to 0."""
    SUBNORMAL = 3
    """Casts to a non-zero subnormal."""
    NORMAL = 4
    OVERFLOW = 5
    """Finite, casts to ±inf (or is clamped)."""
    POSINF = 6
    NEGINF = 7
    NAN = 8
    ABSMAX = 9
    """Largest finite |x| (0 when there is none)."""
    MIN_NONZERO = 10
    """Smallest finite non-zero |x| (inf when there is none)."""


NCOLS = 11
_NCAT = 10  # bucket categories before folding signs, see _boundaries


def _boundaries(fmt: Format, device: torch.device) -> torch.Tensor:
    """Signed, sorted boundaries for ``torch.bucketize(x, b, right=True)``.

    Bucket i holds b[i-1] <= x < b[i]:
      0 -inf | 1 neg overflow | 2 neg normal | 3 neg subnormal | 4 neg underflow | 5 zero |
      6 pos underflow | 7 pos subnormal | 8 pos normal | 9 pos overflow | 10 +inf and NaN
    """
    tiny = torch.finfo(torch.float32).tiny * 2.0**-23  # smallest float32 subnormal
    of, sub = fmt.overflow_threshold, fmt.subnormal_threshold
    uf_next = float(torch.nextafter(torch.tensor(fmt.underflow_threshold), torch.tensor(1.0)))
    f32max = torch.finfo(torch.float32).max
    vals = [-f32max, -of, -(sub - 0.0), -uf_next, -0.0, tiny, uf_next, sub, of, float("inf")]
    # -(sub) must be an exclusive upper bound for neg subnormal; -uf_next inclusive for neg
    # underflow ... with right=True, x in [b[i-1], b[i]); the negative side is mirrored below.
    return torch.tensor(vals, dtype=torch.float32, device=device)


def _fold(counts: torch.Tensor) -> torch.Tensor:
    """Fold the 11 signed buckets into the unsigned columns ZERO..NAN (counts: [n, 11])."""
    zero = counts[:, 5]
    underflow = counts[:, 4] + counts[:, 6]
    subnormal = counts[:, 3] + counts[:, 7]
    normal = counts[:, 2] + counts[:, 8]
    overflow = counts[:, 1] + counts[:, 9]
    neginf = counts[:, 0]
    last = counts[:, 10]  # +inf and NaN land together; NaN is counted apart and subtracted
    return torch.stack([zero, underflow, subnormal, normal, overflow, last, neginf], dim=1)


def _signed_buckets(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Bucket index 0..10 of every element of x (float32), negatives mirrored exactly.

    bucketize is half-open ``[lo, hi)`` on both sides; for negatives we want ``(-hi, -lo]`` so
    that the thresholds act on |x| identically. Bucketizing -x and mirroring does that.
    """
    pos = torch.bucketize(x, bounds, right=True)
    neg = 10 - torch.bucketize(-x, bounds, right=True)
    return torch.where(x < 0, neg, pos)


def tensor_stats(tensors: list[torch.Tensor], fmt: Format = FP16, scale: float = 1.0) -> torch.Tensor:
    """Stats rows ``[len(tensors), NCOLS]`` (float64, on the tensors' device).

    ``scale`` multiplies every value before the cast test (what a loss scale does to gradients).
    """
    if not tensors:
        return torch.zeros((0, NCOLS), dtype=torch.float64)
    device = tensors[0].device
    bounds = _boundaries(fmt, device)
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
    if scale != 1.0:
        flat = flat * scale
    n = len(tensors)
    seg = torch.repeat_interleave(
        torch.arange(n, device=device), torch.tensor(sizes, device=device), output_size=flat.numel()
    )
    buckets = _signed_buckets(flat, bounds)
    counts = torch.bincount(seg * 11 + buckets, minlength=n * 11).view(n, 11).to(torch.float64)
    isnan = torch.isnan(flat)
    nan = torch.zeros(n, dtype=torch.float64, device=device).index_add_(0, seg, isnan.to(torch.float64))
    a = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0).abs_()
    absmax = torch.zeros(n, dtype=torch.float32, device=device).scatter_reduce_(
        0, seg, a, "amax", include_self=True
    )
    nz = torch.where(a > 0, a, torch.full_like(a, float("inf")))
    minnz = torch.full((n,), float("inf"), dtype=torch.float32, device=device).scatter_reduce_(
        0, seg, nz, "amin", include_self=True
    )
    folded = _fold(counts)
    folded[:, 5] -= nan  # the last bucket held +inf and NaN
    numel = torch.tensor(sizes, dtype=torch.float64, device=device)
    return torch.cat(
        [numel[:, None], folded[:, :5], folded[:, 5:6], folded[:, 6:7], nan[:, None],
         absmax.double()[:, None], minnz.double()[:, None]],
        dim=1,
    )


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

    def __init__(self, fmt: Format = FP16, flush_numel: int = 1 << 22, big_numel: int = 1 << 20):
        self.fmt = fmt
        self.flush_numel = flush_numel
        self.big_numel = big_numel
        self._pending: dict[torch.device, _Pending] = {}
        self._keys: list[Hashable] = []
        self._rows: list[torch.Tensor] = []

    def add(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Queue a tensor under ``key``; its row will appear in ``collect`` in queue order."""
        t = tensor.detach()
        if t.numel() >= self.big_numel:
            self._keys.append(key)
            self._rows.append(tensor_stats([t], self.fmt))
            return
        p = self._pending.setdefault(t.device, _Pending([], []))
        p.keys.append(key)
        p.tensors.append(t)
        p.numel += t.numel()
        if p.numel >= self.flush_numel:
            self._flush(t.device)

    def _flush(self, device: torch.device) -> None:
        p = self._pending.pop(device, None)
        if p is None or not p.tensors:
            return
        self._keys.extend(p.keys)
        self._rows.append(tensor_stats(p.tensors, self.fmt))

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

BINADE_MIN = -149
"""Smallest ceil(log2|x|) of a non-zero float32 (the smallest subnormal, 2^-149)."""
BINADE_MAX = 128
"""Largest ceil(log2|x|) of a finite float32 (just below 2^128)."""
NBINADES = BINADE_MAX - BINADE_MIN + 1


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
