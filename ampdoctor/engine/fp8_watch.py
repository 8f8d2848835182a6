"""The Monitor's view of a torchao-converted model: per-GEMM FP8 statistics each step, their history, a forecast.

``Fp8Watch.attach(model)`` returns None for a model without ``Float8Linear`` layers (nothing is hooked).
Otherwise a ``watch.fp8.GemmObserver`` reads each GEMM's operands (its hooks return nothing: the run is
unchanged), and each ``end(step)`` (after the step's backward) copies the step's figures to the host once,
appends them to the per-GEMM log (``<log>.fp8.csv`` beside the step log) and to a ring of the last ``ring``
steps, and returns the alerts it has not given before, one per (Linear, operand):

- ``degenerate``: the scale is infinite, NaN or 0 now (``judge.fp8``'s degenerate scale);
- ``saturated`` / ``flushed``: a share at or above ``judge.fp8.FLUSH_TOLERANCE`` now (any saturation);
- ``forecast``: log2(amax) falls (a least-squares line over the ring's last ``FIT`` steps that drops at
  least ``MIN_FALL`` binade over them) and reaches the amax floor, where the scale degenerates, within
  ``horizon`` steps.
"""

from __future__ import annotations

import csv
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ampdoctor.judge.fp8 import FLUSH_TOLERANCE
from ampdoctor.scaled import OPERAND_FIELDS, GemmRow
from ampdoctor.watch.fp8 import GemmObserver, amax_floor, recipe_of

FIT = 8
"""Steps of amax history the forecast fits a line through."""
MIN_FALL = 1.0
"""Binades the fitted line must fall over those steps (amax halved at least) to be a trend, not batch noise."""
CSV_FIELDS = ("step", "module", "operand", "dtype", "rowwise", *OPERAND_FIELDS)


@dataclass(frozen=True)
class GemmAlert:
    """What the watch found about one operand of one Linear, as data (``report.fp8.alert_words`` says it)."""

    kind: str
    """degenerate | saturated | flushed | forecast"""
    step: int
    module: str
    operand: str
    dtype: str
    value: float
    """The scale (degenerate), the share (saturated, flushed) or the steps left (forecast)."""


def log_path_for(step_log: str | Path | None) -> Path | None:
    """The per-GEMM log beside the step log: ``steps.csv`` -> ``steps.fp8.csv`` (None without a step log)."""
    if step_log is None:
        return None
    p = Path(step_log)
    return p.with_name(p.stem + ".fp8.csv")


class Fp8Watch:
    """Per-GEMM statistics of a converted model, step by step (see the module)."""

    def __init__(self, model: nn.Module, log: str | Path | None = None, ring: int = 256, horizon: int = 1000) -> None:
        self.observer = GemmObserver(model).__enter__()
        self.recipe = recipe_of(model)
        self.ring: deque[list[GemmRow]] = deque(maxlen=max(ring, FIT))
        self.horizon = horizon
        self.said: set[tuple[str, str, str]] = set()
        self.path = Path(log) if log is not None else None
        self._file: Any = None
        self._csv: Any = None

    @classmethod
    def attach(cls, model: nn.Module, log: str | Path | None = None, ring: int = 256,
               horizon: int = 1000) -> Fp8Watch | None:
        return cls(model, log, ring, horizon) if recipe_of(model) is not None else None

    def close(self) -> None:
        self.observer.__exit__()
        if self._file is not None:
            self._file.close()
            self._file = None

    def end(self, step: int) -> list[GemmAlert]:
        """The step's figures (one host copy), logged and kept; the alerts not given before."""
        self.observer._step = step
        rows = self.observer.end_step()
        self.observer.rows.clear()  # the ring keeps the history, bounded
        if not rows:
            return []
        self.ring.append(rows)
        self._write(rows)
        return [a for a in self._now(rows) + self._forecast(step) if self._new(a)]

    def history(self, module: str, operand: str, field: str = "amax") -> list[tuple[int, float]]:
        """(step, value) of one operand's figure over the ring (the last call of the Linear in each step)."""
        out: dict[int, float] = {}
        for rows in self.ring:
            for r in rows:
                if r.module == module and r.operand == operand:
                    out[r.step] = r.stats[field]
        return sorted(out.items())

    def _new(self, a: GemmAlert) -> bool:
        key = (a.kind if a.kind != "forecast" else "degenerate", a.module, a.operand)
        if key in self.said:
            return False
        self.said.add(key)
        return True

    def _write(self, rows: list[GemmRow]) -> None:
        if self.path is None:
            return
        if self._csv is None:
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._file = self.path.open("a", newline="")
            self._csv = csv.DictWriter(self._file, fieldnames=CSV_FIELDS)
            if new:
                self._csv.writeheader()
        for r in rows:
            self._csv.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.flat().items()})
        self._file.flush()

    @staticmethod
    def _now(rows: list[GemmRow]) -> list[GemmAlert]:
        out = []
        for r in rows:
            s = r.stats
            if s["nonfinite"] == 0 and (not math.isfinite(s["scale"]) or s["scale"] == 0):  # (NaN arriving: upstream's)
                out.append(GemmAlert("degenerate", r.step, r.module, r.operand, r.fmt, s["scale"]))
            elif s["saturated"] > 0:
                out.append(GemmAlert("saturated", r.step, r.module, r.operand, r.fmt, s["saturated"]))
            elif s["flushed"] >= FLUSH_TOLERANCE:
                out.append(GemmAlert("flushed", r.step, r.module, r.operand, r.fmt, s["flushed"]))
        return out

    def _forecast(self, step: int) -> list[GemmAlert]:
        if len(self.ring) < FIT:
            return []
        floor = math.log2(amax_floor()) if amax_floor() > 0 else -149.0
        out = []
        for r in self.ring[-1]:
            hist = [(t, v) for t, v in self.history(r.module, r.operand, "min_row_amax")[-FIT:] if v > 0 and math.isfinite(v)]
            if len(hist) < FIT:
                continue
            slope = _slope([(t, math.log2(v)) for t, v in hist])
            if slope * (hist[-1][0] - hist[0][0]) > -MIN_FALL:  # batch-to-batch noise, not a trend
                continue
            left = (math.log2(hist[-1][1]) - floor) / -slope
            if left <= self.horizon:
                out.append(GemmAlert("forecast", step, r.module, r.operand, r.fmt, left))
        return out


def _slope(points: list[tuple[int, float]]) -> float:
    """The least-squares slope of y over x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0
