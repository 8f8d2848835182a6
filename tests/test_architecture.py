"""The public API is what the docs import, and nothing internal; importing it pulls in no framework."""

from __future__ import annotations

import subprocess
import sys

import ampdoctor

DOCUMENTED = {"triage", "layer_stats", "Monitor", "MicroBatches", "Report", "TriageConfig", "read_step_log", "diagnose_scale", "__version__"}


def test_public_api_is_what_the_docs_import() -> None:
    assert set(ampdoctor.__all__) == DOCUMENTED
    for name in ampdoctor.__all__:
        assert getattr(ampdoctor, name) is not None


def test_importing_ampdoctor_imports_no_framework() -> None:
    code = ("import sys, ampdoctor; bad = [m for m in ('transformers', 'lightning', 'accelerate', 'diffusers') "
            "if m in sys.modules]; print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
