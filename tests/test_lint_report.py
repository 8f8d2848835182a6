"""One rule set, two uses: the lint's findings in triage's report (spec and --script), next to the
verdict, in every format; a report without findings renders as before."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.triage import triage
from ampdoctor.input.config import TriageConfig
from ampdoctor.lint import RULES
from ampdoctor.render import html as html_render
from ampdoctor.render import json as json_render
from ampdoctor.render import markdown as md_render
from ampdoctor.render import terminal as term_render
from ampdoctor.report.model import CodeFinding, Report
from tests.report_fixtures import make_report

from .conftest import SAMPLES

FIX4 = next(r.fix for r in RULES if r.code == "AMP004")


def _validate(d: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(resources.files("ampdoctor").joinpath("schema/report.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(d)


def test_amp_misuse_spec_shows_the_hook_that_explains_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(SAMPLES.parent)  # the path as a user types it: the rendering must not depend on the clone's folder
    spec = Path("sample_models") / "amp_misuse.py"
    report, _ = triage(spec, TriageConfig(steps=6))
    assert report.verdict.cause == "amp_misuse"
    assert report.lint == [CodeFinding(str(spec), 17, 35, "AMP004",
                                       "gradient hook hides inf/NaN from GradScaler", FIX4, True)]
    d = json.loads(json_render.render(report))
    _validate(d)
    assert d["lint"][0]["code"] == "AMP004" and d["lint"][0]["explains"] is True
    assert Report.from_dict(d).lint == report.lint
    con = Console(record=True, width=80)
    term_render.render(report, con)
    text = con.export_text()
    lines = text.splitlines()
    at = lines.index("In the code (ampdoctor lint)")
    assert lines[at - 1].startswith("╰")  # right under the verdict panel
    assert lines[at + 1].strip().startswith(f"{spec}:17:35 AMP004 gradient hook hides")
    assert "(can cause amp_misuse)" in " ".join(lines[at + 1: at + 4])
    assert all(len(ln) <= 80 for ln in lines)


def test_a_script_given_to_triage_is_checked_too(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(RULES[0].bad)  # AMP001: clip before unscale_
    report, _ = triage(SAMPLES / "healthy.py", TriageConfig(steps=4), script=script)
    assert [(c.path, c.line, c.col, c.code, c.explains) for c in report.lint] == [(str(script), 12, 5, "AMP001", False)]
    assert report.config["script"] == str(script)
    md = md_render.render(report, {})
    assert "## In the code" in md and f"- `{script}:12:5` **AMP001** clip_grad_norm\\_ before" in md
    assert f"--script {script}" in md_render.reproduce_command(report)  # type: ignore[operator]
    _validate(json.loads(json_render.render(report)))


def test_a_spec_without_findings_renders_as_before() -> None:
    report, _ = triage(SAMPLES / "healthy.py", TriageConfig(steps=4))
    assert report.lint == []
    d = json.loads(json_render.render(report))
    assert "lint" not in d and "script" not in d["config"]
    assert "In the code" not in md_render.render(report, {}) and "In the code" not in html_render.render(report, {})


def test_every_format_shows_hand_made_findings() -> None:
    report = make_report("amp_misuse")
    report.lint = [CodeFinding("train.py", 88, 9, "AMP003", "gradient hook calls clamp() on scaled gradients", "Remove it.", True),
                   CodeFinding("train.py", 120, 5, "AMP013", "checkpoint has the optimizer's state, not the scaler's",
                               "Save it.", False)]
    md = md_render.render(report, {})
    assert md.index("## In the code") < md.index("## What to change")
    assert "- `train.py:88:9` **AMP003** gradient hook calls clamp() on scaled gradients (can cause `amp_misuse`)" in md
    assert "- `train.py:120:5` **AMP013** checkpoint has the optimizer's state, not the scaler's\n  - fix: Save it." in md
    page = html_render.render(report, {})
    assert "<h2>In the code</h2>" in page and "<code>train.py:88:9</code> <b>AMP003</b>" in page
    assert page.index("In the code") < page.index("What to change")
    d = json.loads(json_render.render(report))
    _validate(d)
    assert [x["line"] for x in d["lint"]] == [88, 120]


def test_triage_with_a_missing_script_is_one_line_before_any_stage(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / "healthy.py"), "--script", str(tmp_path / "nope.py")],
                             env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert res.exit_code == 2
    assert res.stderr == f"error: --script {tmp_path / 'nope.py'}: no such file; give the training script that runs this model\n"
