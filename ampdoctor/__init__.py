"""ampdoctor: tells you why mixed-precision training goes NaN or Inf, and what to change.

The public API (what the docs import)::

    from ampdoctor.engine import triage, TriageConfig, Report        # the staged triage of a spec file
    from ampdoctor import layer_stats                         # the per-layer range picture
    from ampdoctor import Monitor, MicroBatches               # your own training loop
    from ampdoctor import read_step_log, diagnose_scale       # GradScaler forensics from a step log

Everything else is internal and may change between versions.
"""

from __future__ import annotations

from ampdoctor._version import __version__
from ampdoctor.engine.layers import layer_stats
from ampdoctor.engine.monitor import Monitor
from ampdoctor.engine.triage import triage
from ampdoctor.input.batches import MicroBatches
from ampdoctor.input.config import TriageConfig
from ampdoctor.report.model import Report
from ampdoctor.report.scaler import diagnose_scale
from ampdoctor.watch.steplog_read import read_step_log

__all__ = [
    "MicroBatches",
    "Monitor",
    "Report",
    "TriageConfig",
    "__version__",
    "diagnose_scale",
    "layer_stats",
    "read_step_log",
    "triage",
]
