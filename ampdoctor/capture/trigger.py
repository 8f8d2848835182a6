"""When a step is a failure worth capturing: ``Trigger`` (what tripped, and why) and ``FailingStep`` (a skip judged by
what the gradients did, not by GradScaler's own working).

A **failing step** is one GradScaler's own working does not explain: a non-finite loss; a skip the scale does not
explain (the growth it needs since the last applied step is a jump, or it came at a scale <= 1: the unscaled
gradients leave FP16), captured from the first skip since the last applied step; without a GradScaler, any
non-finite gradient; the skip-rate alert (calibration not counted; provisional: a later failure is captured beside
it). The Monitor asks (``engine.monitor.skips``, ``capturing``); ``capture.write.Capture`` writes the folder.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ampdoctor.judge.explosion import EXPLODE_RATIO, EXPLODE_WINDOW, explodes
from ampdoctor.judge.scale_facts import DEFAULT_GROWTH_INTERVAL


@dataclass
class Trigger:
    """Why a step counts as the failing step."""

    reason: str
    """nonfinite_loss | nonfinite_grad | skip_rate_alert | nonfinite_update | exploding_update | hidden_overflow"""
    detail: str = ""
    first: int | None = None
    """A failure judged at a skip that follows other skips since the last applied step: the first of them (the
    skipped steps changed neither the weights nor the optimizer state, so the failure starts there)."""
    why: str = ""
    """A skip judged by the gradients (``FailingStep``): ``unscaled`` (the gradients overflow FP16 at a scale <= 1)
    or ``jump`` (the overflow needs the gradients to have grown ``JUMP_RATIO`` times since the last applied step)."""
    need: float | None = None
    """``jump``: the least growth of the largest gradient since the last applied step that the skips imply."""

    @property
    def provisional(self) -> bool:
        """A judgement of a rate or a statistic, not of a step that went wrong: its capture does not spend the
        capture (a later failure still gets one)."""
        return self.reason == "skip_rate_alert" or self.reason.endswith("_spike")


NORMAL_SKIPS = ("calibration", "growth_probe", "backoff", "isolated")
"""GradScaler working as designed (``FailingStep.phase``): none of them is a failure. (``isolated``: the name of a
back-off in captures written before the gradients judged it.)"""


JUMP_RATIO = EXPLODE_RATIO
"""A skip needs the largest gradient to have grown at least this many times since the last applied step: a jump the
scale does not explain (three orders of magnitude, the ratio that calls an applied update exploding)."""


@dataclass
class FailingStep:
    """Which step is the run's failing one: a skip judged by what the gradients did (docs/diagnosis.md, "Which
    skip is a failure").

    GradScaler skips a step when a *scaled* FP16 gradient overflows: ``s * G > F`` (``s`` the scale, ``G`` the
    largest unscaled gradient in the backward's FP16 tensors, ``F`` FP16's max). The last applied step ``a`` had
    ``s_a * G_a <= F`` (``grad_max``: the Monitor's figure of it). A skip at scale ``s`` therefore needs the
    gradient to have grown at least ``need = F / (s * G_a)`` times since ``a``. It is GradScaler's normal working
    (**calibration** above every scale that carried a step, the **growth probe** at a doubled scale, a
    **backoff** while the gradients grow) while ``need < JUMP_RATIO`` and the scale is above 1, however often it
    happens. It is a failure when the scale does not explain it: ``need >= JUMP_RATIO`` (a jump: each further
    consecutive skip halves ``s`` and doubles ``need``, so an overflow that persists is judged within
    ``log2(JUMP_RATIO)`` skips), or a skip at a scale ``<= 1`` (the unscaled gradients themselves leave FP16, the
    definition of ``fp16_grad_overflow``). Such a failure judged at a skip that follows other skips since ``a``
    starts at the first of them (``Trigger.first``). Other failures: a non-finite loss; a non-finite step applied
    (no GradScaler); the skip-rate alert; an update applied although its gradient norm is non-finite (every
    element finite, so GradScaler found no inf: something made the overflowed values finite, a gradient hook's
    ``nan_to_num`` or a clamp) or ``EXPLODE_RATIO`` times the median of the last applied norms (an exploding
    update: the weights take it); an update applied although a gradient recorded in its backward is non-finite,
    on a model carrying the user's gradient hooks (``hidden``: the hooks, in words).
    ``every_skip=True``: every skip of non-finite gradients is a failure (``Monitor(capture_on="skip")``).
    """

    growth_interval: int = DEFAULT_GROWTH_INTERVAL
    every_skip: bool = False
    fmt_max: float = 65504.0
    """The largest finite value of the format the backward runs in (FP16)."""
    phase: str = ""
    """What the last judged step was: '' | 'calibration' | 'growth_probe' | 'backoff' | 'failure'."""
    _peak_applied: float = 0.0
    _prev_scale: float | None = None
    _last_isolated: int | None = None
    _norms: deque[float] = field(default_factory=lambda: deque(maxlen=EXPLODE_WINDOW))
    _grad: Any = None
    """The last applied step's largest unscaled gradient: a float, or a callable that works it out (on a skip)."""
    run_first: int | None = None
    """The first skipped step since the last applied one (None after an applied step)."""
    run_scale: float | None = None
    """The scale ``run_first`` used."""
    run_failed: bool = False
    """The run of skips since ``run_first`` has been judged a failure."""
    need: float | None = None
    """The last skip's ``need`` (None when no applied step's gradient is known)."""

    def judge(self, *, skipped: bool, reason: str, scale: float | None, alert: bool, nonfinite: bool = False,
              step: int = 0, injected: bool = False, norm: float | None = None, hidden: str = "",
              grad_max: Any = None) -> Trigger | None:
        """Whether this step is a failing one; updates the scale history (``phase`` says what it was).
        ``injected``: the fault is known not to come from the loss scale (injected, or another rank's batch,
        forward or loss): a skip of it is a failure whatever the scaler's phase. ``grad_max`` (an applied step):
        its largest unscaled gradient, or a callable returning it (called only if a skip needs it)."""
        grew = scale is not None and self._prev_scale is not None and scale > self._prev_scale
        if scale is not None and math.isfinite(scale):
            self._prev_scale = scale
        if skipped and self.run_first is None:
            self.run_first, self.run_scale, self.run_failed = step, scale, False
        self.phase = ""
        trig: Trigger | None = None
        if skipped and reason == "nonfinite_loss":
            trig = Trigger("nonfinite_loss")  # the forward: no scale explains it
        elif skipped:
            label, why = ("", "") if injected else self._skip_phase(scale, grew)
            if not label or self.every_skip:
                first = self.run_first if why and self.run_first is not None and self.run_first < step else None
                trig = Trigger("nonfinite_grad", reason, first=first, why=why,
                               need=self.need if why == "jump" else None)
            self.phase = label
        else:
            trig = self._applied(reason, nonfinite, norm, hidden, alert)
        if not skipped:
            self.run_first = self.run_scale = None
            self.run_failed = False
            if grad_max is not None:
                self._grad = grad_max
        if not skipped and scale is not None and math.isfinite(scale):
            self._peak_applied = max(self._peak_applied, scale)
        if not skipped and norm is not None and math.isfinite(norm):
            self._norms.append(norm)
        if trig is not None and not self.phase:
            self.phase = "failure"  # (every_skip keeps the label of a normal skip it captures anyway)
        if trig is not None and skipped:
            self.run_failed = True
        return trig

    def _applied(self, reason: str, nonfinite: bool, norm: float | None, hidden: str, alert: bool) -> Trigger | None:
        if nonfinite:  # applied anyway (no GradScaler, the loop did not skip): the weights take it
            return Trigger("nonfinite_loss" if reason == "applied:nonfinite_loss" else "nonfinite_grad", reason)
        if hidden:
            # backward made a non-finite gradient, GradScaler found none in the parameters', and the model carries the
            # user's gradient hooks: one of them made the overflow finite
            return Trigger("hidden_overflow", hidden)
        if norm is not None and not math.isfinite(norm) and not math.isnan(norm):
            # applied with every element finite (GradScaler found no inf) and yet a norm beyond FP32: values made
            # finite at the edge of the format (nan_to_num's float max), the overflow hidden from the scaler
            return Trigger("nonfinite_update", f"gradient norm {norm:g} applied")
        if norm is not None and self._exploded(norm):
            return Trigger("exploding_update", f"gradient norm {norm:.4g} applied, {norm / self._typical():.3g}x the "
                                               f"median of the last {len(self._norms)} applied")
        if alert:
            return Trigger("skip_rate_alert")
        return None

    def grad_max(self) -> float | None:
        """The last applied step's largest unscaled gradient (None when no applied step measured one)."""
        g = self._grad
        if callable(g):
            try:
                g = g()
            except Exception:  # a figure the judgement can go without
                g = None
            self._grad = g
        return float(g) if g is not None and math.isfinite(g) and g > 0 else None

    def _typical(self) -> float:
        return float(statistics.median(self._norms))  # (as np.median: the mean of the middle two of an even count)

    def _exploded(self, norm: float) -> bool:
        return explodes(norm, self._norms)  # (the definition triage applies to FP32's steps: judge.scaler)

    def _skip_phase(self, scale: float | None, grew: bool) -> tuple[str, str]:
        """(the normal phase, '') of a skip the scale explains, else ('', why)."""
        self.need = None
        if scale is None:  # no GradScaler: the loop skipped a non-finite step itself
            return "", ""
        if scale <= 1.0:
            return "", "unscaled"  # s * G > F with s <= 1: G > F, the gradients leave FP16 unscaled
        g = self.grad_max()
        if g is not None:
            self.need = self.fmt_max / (scale * g)
            if self.need >= JUMP_RATIO:
                return "", "jump"
        if scale > self._peak_applied:
            return "calibration", ""  # above every scale that carried a step: still probing from init_scale
        if grew:
            return "growth_probe", ""  # the first step at a doubled scale overflowed: the scale backs off again
        return "backoff", ""  # the gradients grew to the scale's limit: GradScaler backs off, as designed


__all__ = ["FailingStep", "JUMP_RATIO", "NORMAL_SKIPS", "Trigger"]
