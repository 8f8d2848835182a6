"""The monitor's record of a step, its step-log columns, and the names its users catch (warnings, errors)."""

from __future__ import annotations

from dataclasses import dataclass

from ampdoctor.engine.step import Measured
from ampdoctor.errors import AmpDoctorError
from ampdoctor.parallel.registry import engines
from ampdoctor.records import StepRecord
from ampdoctor.report.alerts import first_fault

EXTRA_COLUMNS: tuple[str, ...] = ("scale_after", "skip_rate", "nonfinite_params", "injected")
"""Columns the monitor writes after the standard ones (see ``steplog.COLUMNS``)."""
CAPTURE_COLUMNS: tuple[str, ...] = ("capture_held_bytes",)
"""With a capture armed, after ``EXTRA_COLUMNS``: the host bytes it holds after the step (its last snapshot
and the batches since; bounded by ``capture_hold_bytes``)."""
RANK_COLUMNS: tuple[str, ...] = ("rank", "ranks")
"""Under torch.distributed, after ``EXTRA_COLUMNS``: this rank, and every rank that saw a non-finite
value at the step as ``rank:kind:module`` (``parallel.exchange.RankView.column``), the same on every rank."""
STEP_COLUMNS: tuple[str, ...] = ("step_convention",)
"""Under a framework, after ``EXTRA_COLUMNS``: which number the ``step`` column is (``STEP_CONVENTIONS``)."""
STEP_CONVENTIONS: dict[str, int] = {
    "monitor": 0,
    "trainer_global_step": 1,
    "lightning_global_step": 0,
}
"""What a step log's ``step`` counts, and the number of a fresh run's first step:

- ``monitor``: the monitor's own count of optimizer steps, from ``first_step`` (a loop of your own, accelerate);
- ``trainer_global_step``: the transformers Trainer's ``state.global_step`` after the step, the ``step`` its
  log history gives the step and the N of the ``checkpoint-N`` saved after it (a fresh run's first step is 1);
- ``lightning_global_step``: Lightning's ``trainer.global_step`` while the step runs (before its optimizer
  step), which is the ``step`` its loggers (CSVLogger's ``metrics.csv``) give what the step logged.

A log without the ``step_convention`` column counts as ``monitor`` does."""
STATE_VERSION = 1


class SkipRateError(AmpDoctorError):
    """The rolling skip rate stayed above ``max_skip_rate`` for ``patience`` steps."""


class SkipRateWarning(UserWarning):
    """The rolling skip rate went above ``alert_rate``."""


class MonitorOffWarning(UserWarning):
    """Something inside ampdoctor failed, or the setup is one it cannot read correctly: the monitor turned
    itself off and the training goes on without it."""


UNSUPPORTED = {e.name: e.label for e in engines() if e.sharded and not e.monitored}
"""Sharding engines the monitor cannot read correctly yet: it turns itself off on them, with one warning (DeepSpeed)."""
SHARDED = {e.name: e.label for e in engines() if e.sharded and e.monitored}
"""Sharding engines read through their pieces (``parallel.pieces``): norms and rows reduced across the ranks (every
engine module of ``ampdoctor.parallel`` that says so: ``parallel.protocol.Engine.monitored``)."""


class _Unreadable(Exception):
    """The setup is one the monitor cannot read correctly (a sharded layout it does not reduce yet)."""


MonitorRecord = StepRecord
"""One step as the monitor saw it: the one step record of every driver (``records.StepRecord``)."""


@dataclass(frozen=True)
class FirstFault:
    """The first step at which any rank saw a non-finite value, and who."""

    step: int
    rank: int
    kind: str
    """input | forward | loss | backward | grad (see ``parallel.exchange.KINDS``)."""
    module: str | None
    others_clean: bool
    """No other rank saw it in its own batch, forward, loss or activation gradients: one rank's
    problem (a bad batch, a rank-local overflow), not every rank's."""
    ranks: str
    """Every rank that saw it, as the step log's ``ranks`` column."""
    spread: bool = False
    """Tensor parallelism: the other ranks went bad too, later in the forward, through a collective."""

    def describe(self) -> str:
        """'step 5: rank 1 went non-finite first (input in embed); the other ranks were clean: ... [1:input:embed]'."""
        return first_fault(self.step, self.rank, self.kind, self.module, self.others_clean, self.ranks, self.spread)


@dataclass
class _Pending:
    """What ``after_backward`` learned, waiting for ``after_step``."""

    step: int
    m: Measured
    injected: str



__all__ = ["CAPTURE_COLUMNS", "EXTRA_COLUMNS", "RANK_COLUMNS", "SHARDED", "STATE_VERSION", "STEP_COLUMNS", "STEP_CONVENTIONS",
           "UNSUPPORTED", "FirstFault", "MonitorOffWarning", "MonitorRecord", "SkipRateError", "SkipRateWarning"]
