"""The README's sample output is what `ampdoctor triage sample_models/forward_overflow.py` prints today (80 columns)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import ampdoctor.cli.app as cli

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "ampdoctor triage sample_models/forward_overflow.py"
WIDTH = 80
"""The terminal width the README sample is printed at (the README says so)."""


def readme_sample() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"```text\n\$ " + re.escape(COMMAND) + r"\n(.*?)```", text, re.S)
    assert m, "README.md has no ```text block starting with $ " + COMMAND
    return m.group(1)


def current_output(monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    buf = io.StringIO()
    monkeypatch.setattr(cli, "out", Console(file=buf, width=WIDTH, force_terminal=False, color_system=None))
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(cli.app, COMMAND.split()[1:])
    return r.exit_code, "".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines())


def test_readme_sample_output_is_current(monkeypatch: pytest.MonkeyPatch) -> None:
    code, text = current_output(monkeypatch)
    assert code == 1, text
    assert text == readme_sample(), "README.md's sample output is stale: run python tests/test_readme_sample.py to regenerate it"


def test_readme_image_shows_the_current_run() -> None:
    """docs/img/report-html.png carries the run it shows (docs/gen_report_image.py writes it)."""
    import importlib.util

    from PIL import Image

    from ampdoctor.engine.triage import triage
    from ampdoctor.input.config import TriageConfig

    spec = importlib.util.spec_from_file_location("gen_report_image", ROOT / "docs" / "gen_report_image.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    report, _ = triage(ROOT / gen.SAMPLE, TriageConfig())
    shown = Image.open(gen.IMAGE).text.get("ampdoctor-run")  # type: ignore[attr-defined]
    assert shown == gen.run_lines(report.to_dict()), "the README image is stale: run python docs/gen_report_image.py"


def test_cpu_install_hint_comes_before_the_command() -> None:
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set up"):text.index("## Walkthrough")]
    assert setup.index("download.pytorch.org/whl/cpu") < setup.index("pip install -e .")


if __name__ == "__main__":  # regenerate the README block
    mp = pytest.MonkeyPatch()
    _, out = current_output(mp)
    mp.undo()
    readme = ROOT / "README.md"
    old = readme_sample()
    readme.write_text(readme.read_text().replace(old, out, 1))
    print(f"README.md sample updated ({len(out.splitlines())} lines)")
