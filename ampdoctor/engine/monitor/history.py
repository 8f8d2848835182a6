"""The run's history and state: every skip, every change of scale, and the monitor's ``state_dict``.

The whole scale history is kept compactly (a row per change), and the diagnosis of ``judge.scaler`` reads it
rebuilt step by step. ``state_dict`` holds what a resumed run needs to continue the counts and the log.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ampdoctor.engine.monitor.records import STATE_VERSION
from ampdoctor.errors import UsageError
from ampdoctor.judge.scaler import SkipLedger, skip_ledger
from ampdoctor.report.scaler import ScaleDiagnosis, diagnose_scale, no_scale_history

if TYPE_CHECKING:
    import torch

    from ampdoctor.engine.monitor.monitor import Monitor


class History:
    """Every skipped step with its reason, and the scale each time it changed."""

    def __init__(self) -> None:
        self.total_skips = 0
        self.skips: list[tuple[int, str]] = []
        """(step, reason) of every skipped step."""
        self.scale_changes: list[tuple[int, float]] = []
        """(first step, scale) each time the scale used changed: the whole scale history, compactly."""

    def add(self, step: int, skipped: bool, reason: str, scale: float | None) -> None:
        if skipped:
            self.total_skips += 1
            self.skips.append((step, reason))
        if scale is not None and (not self.scale_changes or self.scale_changes[-1][1] != scale):
            self.scale_changes.append((step, scale))

    def scales(self, first: int, stop: int) -> tuple[list[int], list[float], list[bool]]:
        """(steps, scales used, skipped) for every step in [first, stop), rebuilt from the compact history."""
        steps = list(range(first, stop))
        skipped_set = {s for s, _ in self.skips}
        out: list[float] = []
        ch = self.scale_changes
        j, cur = 0, ch[0][1] if ch else math.nan
        for s in steps:
            while j < len(ch) and ch[j][0] <= s:
                cur = ch[j][1]
                j += 1
            out.append(cur)
        return steps, out, [s in skipped_set for s in steps]

    def diagnose(self, first: int, stop: int, scaler: torch.amp.GradScaler | None) -> ScaleDiagnosis:
        steps, scales, skipped = self.scales(first, stop)
        if scaler is None or not self.scale_changes:
            return no_scale_history()
        return diagnose_scale(scales, skipped, growth_interval=scaler.get_growth_interval(),
                              backoff_factor=scaler.get_backoff_factor(), steps=steps)

    def ledger(self, first: int, stop: int, scaled: bool) -> SkipLedger:
        steps, scales, skipped = self.scales(first, stop)
        reasons = dict(self.skips)
        return skip_ledger(skipped, [reasons.get(s, "") for s in steps], scales if scaled else None, steps)


def state_dict(mon: Monitor) -> dict[str, Any]:
    """Counters and history, to save next to ``scaler.state_dict()`` in a checkpoint."""
    h, r, f = mon.history, mon.rates, getattr(mon, "_failing", None)
    return {
        "version": STATE_VERSION, "step": mon.step_num, "first_step": mon.first_step, "total_skips": h.total_skips,
        "recent": list(r.recent), "over": r.over, "alerted": r.alerted,
        "scale_changes": [list(c) for c in h.scale_changes], "skips": [list(s) for s in h.skips],
        "counted": list(r.counted),
        "failing": ({"peak_applied": f._peak_applied, "prev_scale": f._prev_scale, "last_isolated": f._last_isolated,
                     "grad_max": f.grad_max()} if f is not None else None),
        "first_failure": list(mon.first_failure) if mon.first_failure is not None else None,
    }


def load_state_dict(mon: Monitor, state: dict[str, Any]) -> None:
    """Restore counters and history; the next step continues the step numbers (and the log)."""
    if mon._pending is not None:
        raise UsageError("load_state_dict in the middle of a step")
    if state.get("version") != STATE_VERSION:
        raise UsageError(f"monitor state version {state.get('version')!r} is not {STATE_VERSION}")
    h = mon.history
    mon.step_num = int(state["step"])
    mon.first_step = int(state["first_step"])
    h.total_skips = int(state["total_skips"])
    mon.rates.load(state)
    f = state.get("failing")  # (a state saved before these fields: the scale history starts afresh)
    fs = getattr(mon, "_failing", None)
    if isinstance(f, dict) and fs is not None:
        fs._peak_applied = float(f.get("peak_applied") or 0.0)
        fs._prev_scale = None if f.get("prev_scale") is None else float(f["prev_scale"])
        fs._last_isolated = None if f.get("last_isolated") is None else int(f["last_isolated"])
        fs._grad = None if f.get("grad_max") is None else float(f["grad_max"])  # (the last applied step's G)
    ff = state.get("first_failure")
    mon.first_failure = (int(ff[0]), str(ff[1])) if ff else None
    h.scale_changes = [(int(s), float(v)) for s, v in state["scale_changes"]]
    h.skips = [(int(s), str(r)) for s, r in state["skips"]]
    if mon.off is None:
        mon.hooks.begin_step(mon.step_num)


__all__ = ["History", "load_state_dict", "state_dict"]
