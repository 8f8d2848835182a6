"""ampdoctor: tells you why mixed-precision training goes NaN or Inf, and what to change."""

from __future__ import annotations

__version__ = "0.1.0"

from ampdoctor.engine.layers import layer_stats  # noqa: E402
from ampdoctor.engine.monitor import Monitor  # noqa: E402
from ampdoctor.engine.triage import triage  # noqa: E402
from ampdoctor.formats import FORMATS, Format, get_format  # noqa: E402
from ampdoctor.input.config import TriageConfig  # noqa: E402
from ampdoctor.input.spec import load_spec  # noqa: E402
from ampdoctor.records import StepStats
from ampdoctor.report.model import Report  # noqa: E402
from ampdoctor.watch.hooks import Hooks  # noqa: E402

__all__ = [
    "FORMATS",
    "Format",
    "Hooks",
    "Monitor",
    "Report",
    "StepStats",
    "TriageConfig",
    "get_format",
    "layer_stats",
    "load_spec",
    "triage",
    "__version__",
]
