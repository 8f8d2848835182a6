"""Frozen, validated settings of a ``Monitor``: its keyword arguments, checked once, in one place.

``Monitor(...)``'s keyword arguments stay its public API; ``Monitor.__init__`` builds a ``MonitorConfig``
from them (misuse is a ``UsageError`` at once) and hands it to the parts. What needs the model or the
process group (``inject_param``, ``distributed=True``) is checked by the part that reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ampdoctor.capture.write import DEFAULT_MAX_BYTES
from ampdoctor.engine.monitor.records import STEP_CONVENTIONS
from ampdoctor.engine.ring import SPIKE_WINDOW
from ampdoctor.errors import UsageError
from ampdoctor.judge.history import DEFAULT_HORIZON
from ampdoctor.watch.ring import DEFAULT_STEPS
from ampdoctor.watch.steplog import Mode


def steps(v: int | Iterable[int] | None) -> frozenset[int]:
    """A step, steps, or None, as a set of step numbers."""
    if v is None:
        return frozenset()
    if isinstance(v, int):
        return frozenset({v})
    return frozenset(int(s) for s in v)


@dataclass(frozen=True)
class MonitorConfig:
    """What a ``Monitor`` was asked to do; every field is the keyword argument of the same name."""

    log: str | Path | None = None
    """Path of the step-log CSV (None: no file), written line by line (per rank under torch.distributed)."""
    log_mode: Mode = "append"
    """append (a resumed run appends; a fresh run refuses a log with rows), new, or overwrite."""
    max_norm: float | None = None
    """Clip the global L2 gradient norm to this (None: measure only)."""
    window: int = 1000
    """Steps in the rolling skip rate."""
    alert_rate: float = 0.05
    """Warn (``SkipRateWarning``) when the rolling skip rate goes above this; re-armed when it drops."""
    alert_min_steps: int = 100
    """Steps before the alert is judged (a few calibration skips are normal)."""
    max_skip_rate: float | None = None
    """Raise ``SkipRateError`` when the rolling rate stays above this for ``patience`` steps (None: never)."""
    patience: int = 100
    """See ``max_skip_rate``."""
    every: int = 1
    """Per-layer statistics (``Hooks``) every this-many-th step; the row, norms and skip every step."""
    activations: bool = True
    """Also record module outputs and the gradients at them (the expensive part)."""
    weights: bool = False
    """Also record every parameter's values each recorded step."""
    amp_dtype: torch.dtype | None = None
    """The autocast dtype of ``Monitor.autocast()``; None: float16 with an enabled scaler, else no autocast."""
    inject_inf_at: frozenset[int] = frozenset()
    """Steps at which an Inf is written into a gradient (before ``unscale_``)."""
    inject_param: str | None = None
    """The parameter to inject into (None: the first with a gradient)."""
    inject_spike_at: frozenset[int] = frozenset()
    """Steps at which ``Monitor.spike(target)`` multiplies the targets by ``spike_factor``."""
    spike_factor: float = 1e8
    """See ``inject_spike_at``."""
    keep_stats: bool = True
    """Keep the ``StepStats`` in each returned record."""
    fsync: bool = False
    """fsync the log after every line."""
    capture: str | Path | None = None
    """Folder to write on the first failing step, for ``ampdoctor triage SPEC --from FOLDER`` (None: off)."""
    snapshot_every: int = 100
    """With ``capture``: a host copy of the state every this many steps (and the batches since)."""
    capture_max_bytes: int = DEFAULT_MAX_BYTES
    """Cap on the capture's size; what did not fit is named in its manifest."""
    mode: Literal["full", "sentinel"] = "full"
    """full (per-layer statistics every ``every``-th step) or sentinel (the always-on mode for long runs)."""
    full_every: int = 1000
    """Sentinel mode: full statistics on every this-many-th step."""
    full_after: int = 8
    """Sentinel mode: how many steps after a trip are recorded in full."""
    first_step: int = 0
    """The number of the first step (a resumed run, or a framework's global step)."""
    distributed: bool | None = None
    """The exchange of the first fault across ranks: None on when torch.distributed is initialised; False off."""
    process_group: Any = None
    """The group of the exchange (default: the world)."""
    capture_ranks: Literal["first", "all"] = "first"
    """first: only the rank that went first writes a capture; all: every rank writes its own."""
    capture_on: Literal["failure", "skip"] = "failure"
    """failure: GradScaler's normal skips are no failure; skip: every skip of non-finite gradients is."""
    capture_hold_bytes: int | None = None
    """What the capture may hold on the host between snapshots (None: a thirty-second of the RAM)."""
    quiet: bool = False
    """Keep this monitor's events off the terminal (they still go to the ``ampdoctor`` logger)."""
    step_convention: str | None = None
    """What the step numbers count (``STEP_CONVENTIONS``; None: the monitor's own count, no column)."""
    ring: int = DEFAULT_STEPS
    """Steps the lookback ring keeps (0: no ring, and no forecast or spike)."""
    forecast_horizon: int | None = DEFAULT_HORIZON
    """Warn once (``ForecastWarning``) when a layer is on course to pass the format's max within this many steps."""
    watch_ops: bool = False
    """The forecast reads each op's largest value inside the modules too (``watch.opwatch``; costly on many modules)."""
    spike_sigmas: float | None = None
    """A loss or gradient norm this many robust standard deviations above the median is a failure (None: off)."""
    spike_window: int = SPIKE_WINDOW
    """The applied steps ``spike_sigmas`` judges against."""
    on_record: Callable[[int, dict[str, float]], Any] | None = None
    """Called after every step with (step, figures): ``engine.monitor.figures`` (None: no figures are made)."""

    def __post_init__(self) -> None:
        _check_counts(self)
        _check_modes(self)
        _check_lookback(self)
        if self.on_record is not None and not callable(self.on_record):
            raise UsageError(f"on_record takes a function of (step, figures), got {type(self.on_record).__name__}")

    @property
    def fresh_step(self) -> int:
        """The number of a fresh run's first step under ``step_convention``."""
        return STEP_CONVENTIONS.get(self.step_convention or "monitor", 0)


def _check_counts(c: MonitorConfig) -> None:
    if c.step_convention is not None and c.step_convention not in STEP_CONVENTIONS:
        raise UsageError(f"step_convention must be one of {', '.join(STEP_CONVENTIONS)}, got {c.step_convention!r}")
    if c.window < 1:
        raise UsageError(f"window must be at least 1, got {c.window}")
    if c.max_norm is not None and not c.max_norm > 0:
        raise UsageError(f"max_norm must be positive, got {c.max_norm}")
    if c.max_skip_rate is not None and not 0 <= c.max_skip_rate < 1:
        raise UsageError(f"max_skip_rate must be in [0, 1), got {c.max_skip_rate}")
    if c.snapshot_every < 1:
        raise UsageError(f"snapshot_every must be at least 1, got {c.snapshot_every}")
    if c.first_step < 0:
        raise UsageError(f"first_step must be at least 0, got {c.first_step}")


def _check_modes(c: MonitorConfig) -> None:
    if c.mode not in ("full", "sentinel"):
        raise UsageError(f"mode must be 'full' or 'sentinel', got {c.mode!r}")
    if c.full_every < 1 or c.full_after < 0:
        raise UsageError(f"full_every must be at least 1 and full_after at least 0, got {c.full_every}, {c.full_after}")
    if c.capture_ranks not in ("first", "all"):
        raise UsageError(f"capture_ranks must be 'first' or 'all', got {c.capture_ranks!r}")
    if c.capture_on not in ("failure", "skip"):
        raise UsageError(f"capture_on must be 'failure' or 'skip', got {c.capture_on!r}")


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_lookback(c: MonitorConfig) -> None:
    steps, horizon, sigmas, window = c.ring, c.forecast_horizon, c.spike_sigmas, c.spike_window
    if not _count(steps) or steps < 0:
        raise UsageError(f"ring must be a number of steps (0: off), got {steps!r}")
    if horizon is not None and (not _count(horizon) or horizon < 1):
        raise UsageError(f"forecast_horizon must be a number of steps of at least 1 (None: off), got {horizon!r}")
    if sigmas is not None and not (isinstance(sigmas, (int, float)) and not isinstance(sigmas, bool) and sigmas > 0):
        raise UsageError(f"spike_sigmas must be a positive number of robust standard deviations (None: off), got {sigmas!r}")
    if not _count(window) or window < 16:
        raise UsageError(f"spike_window must be at least 16 steps, got {window!r}")
    if steps == 0 and sigmas is not None:
        raise UsageError("spike_sigmas needs the lookback ring: leave ring at its default or set it above 0")
    if sigmas is not None and steps and steps < window + 8:
        raise UsageError(f"spike_window={window} needs ring of at least {window + 8} steps, got ring={steps}")


def check_types(model: Any, optimizer: Any, scaler: Any) -> None:
    """Misuse of the constructor is a ``UsageError`` naming the argument, at once."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model: Monitor takes the nn.Module you train, got {type(model).__name__}")
    if optimizer is not None and not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "step")):
        raise UsageError(f"optimizer: Monitor takes a torch.optim.Optimizer (or None), got {type(optimizer).__name__}")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("scale", "unscale_", "update", "is_enabled")):
        raise UsageError(f"scaler: Monitor takes a torch.amp.GradScaler (or None), got {type(scaler).__name__}")


def check_loss(loss: Any, where: str) -> None:
    """A loss handed to the Monitor must be the tensor the loop calls ``.backward()`` on: a ``UsageError`` at once."""
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"{where}(loss): the loss must be the tensor you call .backward() on, got {type(loss).__name__}")


__all__ = ["MonitorConfig", "check_loss", "check_types", "steps"]
