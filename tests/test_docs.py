"""Docs that cannot go stale: the spec example and the CLI reference are checked against reality."""

from __future__ import annotations

import re
import subprocess
import sys

from ampdoctor.engine.triage import triage
from ampdoctor.input.config import TriageConfig

from .conftest import ROOT


def test_spec_example_in_docs_is_the_tested_file() -> None:
    doc = (ROOT / "docs" / "spec-format.md").read_text()
    block = re.search(r"## A complete example\n\n```python\n(.*?)```", doc, re.S)
    assert block is not None
    assert block.group(1) == (ROOT / "tests" / "assets" / "spec_example.py").read_text()
    report, _ = triage(ROOT / "tests" / "assets" / "spec_example.py", TriageConfig(steps=10))
    assert report.verdict.cause == "healthy"


def test_cli_reference_is_up_to_date() -> None:
    expected = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_cli.py"), "--stdout"], capture_output=True, text=True, check=True).stdout
    assert (ROOT / "docs" / "cli.md").read_text() == expected, "run: python docs/gen_cli.py"
