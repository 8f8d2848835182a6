"""GradScaler forensics: classify a scale history, list the skips, and recommend scaler settings.

Pure functions over a run's per-step history: the scale each step *used* (``scaler.get_scale()``
before that step's ``update()``, the ``scaler_scale`` column of the step log) and its skip flag.
The scale after step ``i``'s update is the scale step ``i + 1`` used, so a skip at step ``i``
shows as ``scales[i + 1] < scales[i]`` and a growth as ``scales[i + 1] > scales[i]``.

Patterns (``ScaleFacts.pattern``), each with its meaning:

- ``collapsed``: the scale fell below 1, no step was ever applied, or it ended at its minimum
  after falling 8+ binades with most of the last steps skipped. The gradients overflow even
  unscaled; only a scale below 1 fits them, so FP16 has no headroom left for them (bf16, or keep
  the overflowing layer in FP32).
- ``never_growing``: more clean steps in a row than ``growth_interval`` and the scale never grew:
  ``scaler.update()`` is not called every step.
- ``oscillating``: skips after calibration with growth in between: the gradients sit at the
  edge of FP16's range and each growth overflows again.
- ``saturated``: the scale sits at 2^16 or above (up to about 2^24) and the history shows why:
  it bounced off a top there, came down from ``init_scale`` only that far, or grew to 2^24. The
  gradients are small and far from FP16's max. Healthy; near 2^24 check that the loss is not vanishing.
- ``climbing``: the scale is still growing: healthy, still searching upwards.
- ``calibrating``: a few skips at the start, each at a scale no step had been applied at yet, bring
  the scale down from ``init_scale``, then no more: GradScaler found the largest scale the
  gradients allow. Normal.
- ``stable``: the scale did not move (isolated skips, if any, are listed). A scale that never moved
  in fewer clean steps than ``growth_interval`` says nothing about the gradients' size: GradScaler
  never tried a larger one.

Every function is linear in the number of steps (numpy over the whole history; ``bench/bench_scaler.py``
times a 1e6-step log).

Recommendations give ``init_scale``, ``growth_interval`` and ``backoff_factor`` values computed
from the history (the scale the run settled at, the clean steps between skips, the runs of
consecutive skips), in ``ScaleFacts.settings`` and as ``Advice`` codes. No English here: the classes and the
advice are codes with their figures (``ScaleFacts.finding``, ``ScaleFacts.advice``), and
``ampdoctor.report.scaler`` words them (``report.words.scaler``).

This module holds the entry (``diagnose_scale``), the skip ledger, the inferred settings and the rolling skip rate;
the facts and their thresholds are in ``scale_facts``, the classifier in ``scale_tracker``, the streaming pass over
a step log in ``log_digest``, the exploding update in ``explosion``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ampdoctor.judge.scale_facts import ScaleFacts
from ampdoctor.judge.scale_tracker import ScaleTracker


@dataclass
class SkipRun:
    """Consecutive skipped steps."""

    start: int
    end: int
    reasons: list[str]

    @property
    def length(self) -> int:
        return len(self.reasons)


@dataclass
class SkipLedger:
    """Which steps were skipped, why, at which scale, and the runs of consecutive skips."""

    steps: list[int]
    reasons: list[str]
    scales: list[float | None]
    runs: list[SkipRun]
    total_steps: int

    @property
    def count(self) -> int:
        return len(self.steps)

    @property
    def rate(self) -> float:
        return self.count / self.total_steps if self.total_steps else 0.0

    @property
    def longest_run(self) -> int:
        return max((r.length for r in self.runs), default=0)

    def by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.reasons:
            key = r or "(no reason logged)"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def skip_ledger(
    skipped: Sequence[bool],
    reasons: Sequence[str] | None = None,
    scales: Sequence[float | None] | None = None,
    steps: Sequence[int] | None = None,
) -> SkipLedger:
    """The skip ledger of a run. A run of consecutive skips is consecutive rows (steps)."""
    n = len(skipped)
    st = list(steps) if steps is not None else list(range(n))
    rs = reasons if reasons is not None else [""] * n
    sc: Sequence[float | None] = scales if scales is not None else [None] * n
    idx = np.flatnonzero(np.asarray(skipped, dtype=bool)).tolist()
    runs: list[SkipRun] = []
    for i in idx:
        if runs and i > 0 and skipped[i - 1] and runs[-1].end == st[i - 1]:
            runs[-1].end = st[i]
            runs[-1].reasons.append(rs[i])
        else:
            runs.append(SkipRun(st[i], st[i], [rs[i]]))
    return SkipLedger([st[i] for i in idx], [rs[i] for i in idx], [sc[i] for i in idx], runs, n)


def _arrays(scales: Sequence[float], skipped: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(scales, dtype=np.float64), np.asarray(skipped, dtype=bool)


def infer_backoff(scales: Sequence[float], skipped: Sequence[bool]) -> float | None:
    """Median of ``scale[i+1] / scale[i]`` over skipped steps i where the scale fell."""
    sc, sk = _arrays(scales, skipped)
    a, b = sc[:-1], sc[1:]
    fell = sk[:-1] & (b > 0) & (b < a)
    ratios = (b[fell] / a[fell]).tolist()
    return float(statistics.median(ratios)) if ratios else None


def infer_growth_interval(scales: Sequence[float], skipped: Sequence[bool]) -> int | None:
    """Fewest clean steps (since the last skip or scale change) that preceded a growth."""
    sc, sk = _arrays(scales, skipped)
    if len(sc) < 2:
        return None
    grew = ~sk[:-1] & (sc[1:] > sc[:-1])
    # the clean count restarts after every skip and every scale change; between two restarts all steps are clean
    resets = np.flatnonzero(sk[:-1] | (sc[1:] != sc[:-1]))
    clean = np.diff(resets, prepend=-1)[grew[resets]]
    return int(clean.min()) if clean.size else None


def _clean_runs_between(skip_idx: list[int], n: int, skipped: Sequence[bool]) -> list[int]:
    """Clean steps between consecutive (non-adjacent) skips in ``skip_idx``."""
    if len(skip_idx) < 2:
        return []
    clean_before = np.concatenate([[0], np.cumsum(~np.asarray(skipped, dtype=bool))])  # clean steps in [0, i)
    idx = np.asarray(skip_idx)
    gaps = clean_before[idx[1:]] - clean_before[idx[:-1] + 1]
    return [int(g) for g in gaps if g]


def diagnose_scale(
    scales: Sequence[float],
    skipped: Sequence[bool],
    *,
    growth_interval: int | None = None,
    backoff_factor: float | None = None,
    init_scale: float | None = None,
    steps: Sequence[int] | None = None,
    nonfinite: Sequence[bool] | None = None,
) -> ScaleFacts:
    """Classify the history of a GradScaler (one scale used and one skip flag per step).

    ``nonfinite``: steps whose loss was non-finite (NaN/Inf from the data or the forward). Their skips are never
    calibration: no loss scale makes a forward value finite, so such a skip says nothing about the scale the gradients
    allow (they count with the skips after calibration, the batches to check).

    ``growth_interval`` and ``backoff_factor`` are the scaler's settings when known; otherwise
    they are inferred from the history (2000 and 0.5, PyTorch's defaults, when it shows none).
    ``steps`` names the rows (default 0..n-1); every step list in the result uses those names.
    A history too long to hold goes through ``ScaleTracker`` in chunks, with the same result.
    """
    t = ScaleTracker()
    t.feed(scales, skipped, steps, nonfinite)
    return t.diagnose(growth_interval=growth_interval, backoff_factor=backoff_factor, init_scale=init_scale)


def _longest_run(flags: Sequence[bool] | np.ndarray) -> int:
    f = np.asarray(flags, dtype=bool)
    if not f.any():
        return 0
    edges = np.flatnonzero(np.diff(np.concatenate([[0], f.astype(np.int8), [0]])))  # run starts, run ends
    return int((edges[1::2] - edges[::2]).max())


def rolling_skip_rate(skipped: Sequence[bool], window: int = 1000) -> list[float]:
    """Skip rate over the last ``window`` steps (fewer at the start), one value per step."""
    c = np.concatenate([[0], np.cumsum(np.asarray(skipped, dtype=np.int64))])
    i = np.arange(1, len(c))
    counts = c[1:] - c[np.maximum(i - window, 0)]
    return (counts / np.minimum(i, window)).tolist()


