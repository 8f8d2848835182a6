"""Scan every batch for values FP16 training cannot take, whatever the verdict.

Pure measurement over the cached batches; returns data (``DataIssue``), never English. Rules:

* ``nonfinite``: NaN/±Inf elements (batch, field, samples, count);
* ``sentinel``: one exact value that repeats (two or more elements of a field, over all batches)
  and is an outlier (below): a fill constant such as -999999 or 9.97e36, not a measurement;
* ``outlier``: finite elements at least ``OUTLIER_RATIO`` (three orders of magnitude) above the
  field's typical magnitude, the median over batches of each batch's median non-zero |x|
  (a median of medians: values in under half of the elements cannot move it; a batch's median is
  taken over an evenly strided subsample of at most ~``MEDIAN_SAMPLE`` elements);
* ``beyond_fp16``: finite elements that are not outliers but overflow when cast to FP16
  (|x| ≥ 65520), so raw FP16 (``model.half()``) or the first autocast op turns them into inf.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ampdoctor.formats import FP16
from ampdoctor.input.batches import Batches, fields
from ampdoctor.judge.thresholds import OUTLIER_RATIO

MEDIAN_SAMPLE = 100_000
"""A batch's median |x| is taken over an evenly strided subsample of about this many elements."""


@dataclass(frozen=True)
class DataIssue:
    kind: str
    """nonfinite | sentinel | outlier | beyond_fp16"""
    field: str
    batches: tuple[int, ...]
    """Batch indices holding it (the first is the one to look at)."""
    samples: tuple[int, ...]
    """Sample indices (dim 0) in the first batch."""
    count: int
    """Elements concerned, over all batches."""
    value: float
    """The sentinel value; the largest |x| for outliers and beyond_fp16; NaN for nonfinite."""
    typical: float
    """The field's typical magnitude (median of per-batch median non-zero |x|)."""
    extra: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)


def _rows(mask: torch.Tensor) -> list[int]:
    if mask.dim() == 0:
        return [0] if bool(mask) else []
    return torch.nonzero(mask.reshape(mask.shape[0], -1).any(dim=1)).flatten().tolist()


def typical_magnitudes(batches: Batches) -> dict[str, float]:
    """Per field: median over batches of the batch's median non-zero finite |x|."""
    meds: dict[str, list[float]] = {}
    for b in batches.items:
        for name, t in fields(b):
            flat = t.detach().reshape(-1)
            a = flat[:: max(1, flat.numel() // MEDIAN_SAMPLE)].float().abs()  # a strided subsample bounds the cost
            a = a[torch.isfinite(a) & (a > 0)]
            if a.numel():
                meds.setdefault(name, []).append(float(a.median()))
    return {k: float(np.median(v)) for k, v in meds.items()}


def _quiet(t: torch.Tensor, typ: float) -> bool:
    """One pass: all finite (min/max propagate NaN and inf) and nothing large enough to report."""
    if t.numel() == 0:
        return True
    lo, hi = (float(v) for v in torch.aminmax(t))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return False
    big = max(-lo, hi)
    return big < FP16.overflow_threshold and (typ <= 0 or big < OUTLIER_RATIO * typ)


def scan_batches(batches: Batches) -> list[DataIssue]:
    """Every issue of every batch, in batch order (sentinels once per field and value)."""
    typical = typical_magnitudes(batches)
    # pass 1: collect big values per field to find repeated constants
    big_vals: dict[str, dict[float, list[int]]] = {}
    per_batch: list[list[tuple[str, torch.Tensor]]] = [[(n, t.detach().float()) for n, t in fields(b)] for b in batches.items]
    quiet = [[_quiet(t, typical.get(name, 0.0)) for name, t in fs] for fs in per_batch]
    for i, fs in enumerate(per_batch):
        for j, (name, t) in enumerate(fs):
            if quiet[i][j]:
                continue
            typ = typical.get(name, 0.0)
            fin = torch.isfinite(t)
            big = fin & ((t.abs() >= OUTLIER_RATIO * typ) if typ > 0 else torch.zeros_like(fin))
            if bool(big.any()):
                vals, counts = torch.unique(t[big], return_counts=True)
                for v, c in zip(vals.tolist(), counts.tolist(), strict=True):
                    big_vals.setdefault(name, {}).setdefault(float(v), []).extend([i] * int(c))
    sentinels = {name: {v for v, where in d.items() if len(where) >= 2} for name, d in big_vals.items()}
    out: list[DataIssue] = []
    for name, d in big_vals.items():
        for v in sorted(sentinels[name], key=lambda x: -len(d[x])):
            where = sorted(set(d[v]))
            t = dict(per_batch[where[0]])[name]
            out.append(DataIssue("sentinel", name, tuple(where), tuple(_rows(t == v)), len(d[v]), v, typical[name]))
    for i, fs in enumerate(per_batch):
        for j, (name, t) in enumerate(fs):
            if quiet[i][j]:
                continue
            typ = typical.get(name, 0.0)
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                out.append(DataIssue("nonfinite", name, (i,), tuple(_rows(bad)), int(bad.sum()), float("nan"), typ))
            fin = ~bad
            a = torch.where(fin, t.abs(), torch.zeros_like(t))
            sent = torch.zeros_like(fin)
            for v in sentinels.get(name, ()):
                sent |= t == v
            free = fin & ~sent
            outl = free & (a >= OUTLIER_RATIO * typ) if typ > 0 else torch.zeros_like(fin)
            if bool(outl.any()):
                out.append(DataIssue("outlier", name, (i,), tuple(_rows(outl)), int(outl.sum()),
                                     float(a[outl].max()), typ, {"ratio": float(a[outl].max()) / typ}))
            over = free & ~outl & (a >= FP16.overflow_threshold)
            if bool(over.any()):
                out.append(DataIssue("beyond_fp16", name, (i,), tuple(_rows(over)), int(over.sum()),
                                     float(a[over].max()), typ))
    return out


def issues_in_batch(issues: list[DataIssue], batch: int) -> list[DataIssue]:
    return [d for d in issues if batch in d.batches]


def largest_beyond(batch: Any, limit: float) -> tuple[str, tuple[int, ...], float, int] | None:
    """(field, index, value, count) of a batch's largest finite |x| at or beyond ``limit`` (the format's overflow
    threshold): where it sits, the value, and how many of the field's elements are beyond; None when none is."""
    best = None
    for name, t in fields(batch):
        a = torch.where(torch.isfinite(t), t.detach().float().abs(), torch.zeros((), dtype=torch.float32))
        n = int((a >= limit).sum())
        if n and (best is None or float(a.max()) > abs(best[2])):
            idx = tuple(int(i) for i in np.unravel_index(int(a.argmax()), tuple(t.shape)))
            best = (name, idx, float(t[idx]), n)
    return best
