"""ampdoctor: tells you why mixed-precision training goes NaN or Inf, and what to change."""

from __future__ import annotations

__version__ = "0.1.0"

from ampdoctor.config import TriageConfig  # noqa: E402
from ampdoctor.formats import FORMATS, Format, get_format  # noqa: E402
from ampdoctor.hooks import Hooks, StepStats  # noqa: E402
from ampdoctor.layers import layer_stats  # noqa: E402
from ampdoctor.monitor import Monitor  # noqa: E402
from ampdoctor.report import Report  # noqa: E402
from ampdoctor.spec import load_spec  # noqa: E402
from ampdoctor.triage import triage  # noqa: E402

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
