"""The public API is what the docs import, and nothing internal; importing it pulls in no framework; no function
is longer than 80 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


def test_no_function_in_ampdoctor_is_longer_than_80_lines() -> None:
    """A function is read whole: from its def line to its last line, 80 lines at most."""
    pkg = Path(__file__).resolve().parents[1] / "ampdoctor"
    long = [f"{p.relative_to(pkg)}:{n.lineno} {n.name} ({(n.end_lineno or n.lineno) - n.lineno + 1} lines)"
            for p in sorted(pkg.rglob("*.py"))
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n.end_lineno or n.lineno) - n.lineno + 1 > 80]
    assert not long, long
