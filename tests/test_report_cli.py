"""--report / --dump-dir on `ampdoctor triage`: schema of real reports, never overwrite without --force, atomic writes."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.triage import triage
from ampdoctor.errors import OutputError
from ampdoctor.input.config import TriageConfig
from ampdoctor.report.build import enrich

jsonschema = pytest.importorskip("jsonschema")
runner = CliRunner()


def schema() -> dict:
    return json.loads(resources.files("ampdoctor").joinpath("schema/report.schema.json").read_text())


def test_schema_is_valid_draft_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(schema())


@pytest.mark.parametrize("sample", ["data_nan.py", "healthy.py"])
def test_real_reports_validate(samples: Path, sample: str) -> None:
    report, run = triage(samples / sample, TriageConfig(steps=3, device="cpu"))
    enrich(report, run.results)
    d = json.loads(json.dumps(report.to_dict()))
    jsonschema.Draft202012Validator(schema()).validate(d)


def test_report_md_and_dump_dir_end_to_end(samples: Path, tmp_path: Path) -> None:
    md, dump = tmp_path / "bug.md", tmp_path / "dump"
    res = runner.invoke(app, ["triage", str(samples / "forward_overflow.py"), "--steps", "3", "--device", "cpu",
                              "--report", str(md), "--dump-dir", str(dump), "--json", str(tmp_path / "r.json"), "-q"])
    assert res.exit_code == 1, res.output
    text = md.read_text()
    assert "FP16 forward overflow" in text and "--seed 0" in text
    assert (tmp_path / "bug_files" / "loss.png").exists() or "pip install" in text
    d = json.loads((tmp_path / "r.json").read_text())
    jsonschema.Draft202012Validator(schema()).validate(d)
    assert d["layer_steps"], "the heatmap data is in the JSON report"
    assert sorted(p.name for p in dump.iterdir()) == ["batch.pt", "failure.json", "report.json", "repro.py", "weights.pt"]
    failure = json.loads((dump / "failure.json").read_text())
    assert failure["step"] == 0 and failure["stage"] == "amp" and failure["module"]
    assert failure["module_inputs"]["fp32"], "the module's input statistics are saved"
    compile((dump / "repro.py").read_text(), "repro.py", "exec")


def test_report_given_twice_writes_both(samples: Path, tmp_path: Path) -> None:
    md, page = tmp_path / "bug.md", tmp_path / "bug.html"
    res = runner.invoke(app, ["triage", str(samples / "healthy.py"), "--steps", "2", "--device", "cpu",
                              "--report", str(md), "--report", str(page)])
    assert res.exit_code == 0, res.output
    assert md.read_text().startswith("#") and "<html" in page.read_text()
    assert f"report written to {md}" in res.output.replace("\n", "") and f"report written to {page}" in res.output.replace("\n", "")
    res = runner.invoke(app, ["triage", str(samples / "healthy.py"), "--report", str(tmp_path / "a.md"),
                              "--report", str(tmp_path / "a.md")])
    assert res.exit_code == 2 and "--report and --report both name" in res.output, res.output


def test_existing_outputs_are_refused_before_anything_runs(tmp_path: Path) -> None:
    spec = tmp_path / "never_runs.py"
    marker = tmp_path / "ran"
    spec.write_text(f"open({str(marker)!r}, 'w').close()\ndef build_model(): ...\ndef build_dataloader(): ...\n")
    old = tmp_path / "r.html"
    old.write_text("old")
    res = runner.invoke(app, ["triage", str(spec), "--report", str(old)])
    assert res.exit_code == 2 and "--force" in res.output
    assert old.read_text() == "old" and not marker.exists()
    dump = tmp_path / "d"
    dump.mkdir()
    (dump / "x").write_text("keep")
    res = runner.invoke(app, ["triage", str(spec), "--dump-dir", str(dump)])
    assert res.exit_code == 2 and "not empty" in res.output and not marker.exists()
    (tmp_path / "m_files").mkdir()
    (tmp_path / "m_files" / "loss.png").write_bytes(b"old")
    res = runner.invoke(app, ["triage", str(spec), "--report", str(tmp_path / "m.md")])
    assert res.exit_code == 2 and not marker.exists()


def test_unknown_extension_is_one_line_exit_2(tmp_path: Path) -> None:
    res = runner.invoke(app, ["triage", str(tmp_path / "x.py"), "--report", str(tmp_path / "r.pdf")])
    assert res.exit_code == 2
    assert "unknown extension '.pdf'" in res.output and len(res.output.strip().splitlines()) == 1


def test_force_overwrites_and_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.cli import reports as cli_report
    from tests.report_fixtures import make_report

    path = tmp_path / "r.json"
    path.write_text("old")
    with pytest.raises(Exception, match="--force"):
        cli_report.check_report_path(path, force=False)
    cli_report.check_report_path(path, force=True)

    def crash(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OutputError, match="cannot write .*r\\.(html|json): disk full"):
        cli_report.write_report(path, make_report())
    assert path.read_text() == "old", "a failed write leaves the old file"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"], "no temp file is left behind"
    monkeypatch.undo()
    cli_report.write_report(path, make_report())
    assert json.loads(path.read_text())["verdict"]["cause"] == "fp16_forward_overflow"
