"""`ampdoctor lint`: a folder of one script per rule, the output formats, exit codes, noqa,
--select/--ignore and [tool.ampdoctor.lint]; the project's own samples, bench and tests raise nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.lint import RULES, Selection, lint_paths

from .conftest import ROOT

ENV = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(app, ["lint", *args], env=ENV)
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture
def per_rule(tmp_path: Path) -> Path:
    """One small script per rule, named after it (its bad snippet)."""
    folder = tmp_path / "scripts"
    folder.mkdir()
    for r in RULES:
        (folder / f"{r.code.lower()}.py").write_text(r.bad)
    return folder


def test_a_folder_of_one_script_per_rule_reports_each_at_its_line(per_rule: Path) -> None:
    code, out, err = run("--format", "concise", str(per_rule))
    assert code == 1 and err == ""
    lines = out.splitlines()
    want = [f"{per_rule / (r.code.lower() + '.py')}:{r.bad_at[0]}:{r.bad_at[1]}: {r.code} " for r in RULES]
    assert [ln[: len(w)] for ln, w in zip(lines, want, strict=False)] == want
    assert lines[-1] == f"Found {len(RULES)} findings in {len(RULES)} files ({len(RULES)} files checked)."


def test_text_format_shows_the_fix_under_each_finding_within_80_columns(per_rule: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(per_rule)
    code, out, _ = run("amp001.py")
    assert code == 1
    assert out.splitlines()[0] == "amp001.py:12:5: AMP001 clip_grad_norm_ before scaler.unscale_(optimizer)"
    assert out.splitlines()[1].startswith("    fix: Call scaler.unscale_(optimizer) right before clipping;")
    assert all(len(ln) <= 80 for ln in out.splitlines()), out


def test_clean_files_exit_0(tmp_path: Path) -> None:
    for r in RULES:
        (tmp_path / f"{r.code.lower()}.py").write_text(r.good)
    code, out, _ = run(str(tmp_path))
    assert code == 0
    assert out == f"No AMP mistakes found ({len(RULES)} files checked).\n"


ANNOTATION = re.compile(r"^::warning file=[^,:]+,line=\d+,col=\d+,title=AMP\d{3}::[^\r\n]+$")
"""GitHub's workflow command syntax: ::warning file={name},line={line},col={col},title={title}::{message},
with %, CR and LF escaped in the message, and also ':' and ',' in the properties."""


def test_github_annotations(per_rule: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(per_rule)
    code, out, _ = run("--format", "github", ".")
    assert code == 1
    lines = out.splitlines()
    assert len(lines) == len(RULES) and all(ANNOTATION.match(ln) for ln in lines), lines
    first = lines[0]
    assert first.startswith("::warning file=amp001.py,line=12,col=5,title=AMP001::clip_grad_norm_ before")
    assert "%0Afix: Call scaler.unscale_(optimizer)" in first


def test_github_escapes_properties_and_data() -> None:
    from ampdoctor.cli.lint import github_line
    from ampdoctor.lint import LintFinding

    line = github_line(LintFinding("a,b:c%.py", 3, 4, "AMP009", "100% sure\nreally"))
    assert line.startswith("::warning file=a%2Cb%3Ac%25.py,line=3,col=4,title=AMP009::100%25 sure%0Areally%0Afix: ")


def test_json_format(per_rule: Path) -> None:
    code, out, _ = run("--format", "json", str(per_rule / "amp013.py"))
    assert code == 1
    data = json.loads(out)
    assert data == [{"path": str(per_rule / "amp013.py"), "line": 7, "col": 12, "code": "AMP013",
                     "message": "checkpoint has the optimizer's state, not the scaler's",
                     "fix": RULES[12].fix}]
    assert run("--format", "json", str(per_rule / "missing.py"))[0] == 2


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    code, out, err = run(str(tmp_path / "nope.py"))
    assert code == 2 and out == ""
    assert err == f"error: {tmp_path / 'nope.py'}: no such file or folder; give Python files or folders to check\n"
    code, _, err = run("--select", "AMP999", str(tmp_path))
    assert code == 2 and err.startswith("error: --select: no rule 'AMP999'; the rules are AMP001..AMP015")
    code, _, err = run("--format", "xml", str(tmp_path))
    assert code == 2 and "--format takes text, concise, github, json" in err
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    (tmp_path / "fine.py").write_text(RULES[0].bad)
    code, out, err = run("--format", "concise", str(tmp_path))
    assert code == 2  # the other file is still checked and reported
    assert "fine.py:12:5: AMP001" in out
    assert err.startswith(f"error: {broken}:1:7: cannot parse (")
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_select_ignore_and_noqa(per_rule: Path) -> None:
    code, out, _ = run("--format", "concise", "--select", "AMP001,AMP01", str(per_rule))
    assert [ln.split()[1] for ln in out.splitlines()[:-1]] == ["AMP001", *[f"AMP0{i}" for i in range(10, 16)]]
    code, out, _ = run("--format", "concise", "--ignore", "AMP0", str(per_rule))
    assert code == 0
    f = per_rule / "amp005.py"
    f.write_text(f.read_text().replace("lr=1e-3)", "lr=1e-3)  # noqa: AMP005"))
    assert run(str(f))[0] == 0


def test_pyproject_table_is_read_from_the_nearest(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "train.py").write_text(RULES[0].bad)
    (proj / "src" / "old.py").write_text(RULES[1].bad)
    (proj / "pyproject.toml").write_text('[tool.ampdoctor.lint]\nignore = ["AMP002"]\nexclude = ["old.py"]\n')
    code, out, _ = run("--format", "concise", str(proj / "src"))
    assert code == 1 and out.splitlines()[0].endswith("AMP001 clip_grad_norm_ before scaler.unscale_(optimizer)")
    assert "(1 file checked)" in out
    (proj / "pyproject.toml").write_text('[tool.ampdoctor.lint]\nselect = ["AMP002"]\n')
    code, out, _ = run("--format", "concise", str(proj / "src"))
    assert [ln.split()[1] for ln in out.splitlines()[:-1]] == ["AMP002"]
    (proj / "pyproject.toml").write_text('[tool.ampdoctor.lint]\nselct = ["AMP002"]\n')
    code, _, err = run(str(proj))
    assert code == 2 and "has no key 'selct'; the keys are select, ignore, exclude" in err
    (proj / "pyproject.toml").write_text('[tool.ampdoctor.lint\n')
    code, _, err = run(str(proj))
    assert code == 2 and "not valid TOML" in err


def test_list_rules_fits_80_columns() -> None:
    code, out, _ = run("--list-rules")
    assert code == 0
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines] == [r.code for r in RULES]
    assert all(len(ln) <= 80 for ln in lines), [ln for ln in lines if len(ln) > 80]


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_the_projects_own_code_raises_nothing() -> None:
    res = lint_paths([ROOT / "sample_models", ROOT / "bench", ROOT / "tests"], Selection())
    assert res.errors == []
    assert [f"{f.location()} {f.code}" for f in res.findings] == []
    assert res.files > 50


def test_with_amp_the_samples_show_the_mistakes_they_are_about() -> None:
    res = lint_paths([ROOT / "sample_models"], Selection(), amp=True)
    assert [(Path(f.path).name, f.line, f.col, f.code) for f in res.findings] == [
        ("amp_misuse.py", 17, 35, "AMP004"),  # the nan_to_num hook
        ("cuda_softmax.py", 31, 25, "AMP009"),  # the hand-written softmax (exp without the max subtracted)
        ("loss_fault.py", 35, 23, "AMP010"), ("loss_fault.py", 35, 53, "AMP010"),  # log(p), log(1 - p) of a sigmoid
        ("model_loss.py", 28, 38, "AMP010"), ("model_loss.py", 28, 68, "AMP010")]


def test_docs_show_every_rule_with_its_snippets_and_the_cli_reference_has_lint() -> None:
    doc = (ROOT / "docs" / "lint.md").read_text()
    for r in RULES:
        assert f"### {r.code} {r.name}" in doc and f"| [{r.code}](#{r.code.lower()}-{r.name}) |" in doc
        at = doc.index(f"### {r.code} {r.name}")
        section = doc[at: doc.find("\n### ", at + 1)]
        assert f"```python\n{r.bad}```" in section and f"```python\n{r.good}```" in section, r.code
        assert r.fix in section and f"line {r.bad_at[0]}, column {r.bad_at[1]}" in section
    assert "## `ampdoctor lint`" in (ROOT / "docs" / "cli.md").read_text()
