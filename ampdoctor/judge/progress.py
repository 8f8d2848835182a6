"""The loss windows behind the stall rule, in words: what "N% of FP32's progress" compared.

``diagnosis.stall_ratio`` compares the mean loss over the last quarter of the steps against FP32's
(both from FP32's mean over the first quarter). A verdict that quotes only the ratio sits beside a
table of final losses, one noisy step each, which can disagree with it; this module gives the
windowed means the rule used so the summary can show them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LossWindow:
    """The numbers the stall rule compares (the same as ``diagnosis.stall_ratio``)."""

    steps: int
    """Steps both stages ran (the rule's n)."""
    window: int
    """Steps in each window (a quarter of n, at least 2)."""
    fp32_head: float
    """FP32's mean loss over the first ``window`` steps."""
    fp32_tail: float
    """FP32's mean loss over the last ``window`` steps."""
    target_tail: float
    """The target's mean loss over the last ``window`` steps."""

    @property
    def ratio(self) -> float:
        """(fp32_head - target_tail) / (fp32_head - fp32_tail): the share of FP32's progress the target made."""
        if not math.isfinite(self.target_tail):
            return 0.0
        return (self.fp32_head - self.target_tail) / (self.fp32_head - self.fp32_tail)


def loss_window(target: Any, fp32: Any, min_steps: int = 8) -> LossWindow | None:
    """The windows of ``stall_ratio`` for two StageResults (None exactly where it returns None)."""
    n = min(len(target.records), len(fp32.records))
    if n < min_steps:
        return None
    ref = [r.loss for r in fp32.records[:n]]
    tgt = [r.loss for r in target.records[:n]]
    if not all(math.isfinite(v) for v in ref):
        return None
    k = max(2, n // 4)
    head32 = float(np.mean(ref[:k]))
    tail32 = float(np.mean(ref[-k:]))
    if head32 == 0 or head32 - tail32 <= 1e-2 * abs(head32):
        return None
    return LossWindow(n, k, head32, tail32, float(np.mean(tgt[-k:])))
