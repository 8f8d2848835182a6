"""Outputs: checked before any stage runs, `--json -`, square brackets and Markdown escaping, 80 columns and pipes."""

from __future__ import annotations

import io
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.records import LayerRow, ScaleEvent
from ampdoctor.render import markdown as md_render
from ampdoctor.render.terminal import render as render_terminal

from .report_fixtures import make_report
from .test_report_render import golden

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
HEALTHY = str(ROOT / "sample_models" / "healthy.py")


@pytest.fixture
def readonly(tmp_path: Path) -> Path:
    """A folder nobody can write into: chmod 555, or (as root, whom modes do not stop) /sys."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        fd, probe = tempfile.mkstemp(dir=d)
    except OSError:
        yield d
    else:
        os.close(fd)
        os.unlink(probe)
        try:
            fd, probe = tempfile.mkstemp(dir="/sys")
        except OSError:
            yield Path("/sys")
        else:  # pragma: no cover - a machine with a writable /sys
            os.close(fd)
            os.unlink(probe)
            pytest.skip("no unwritable folder on this machine")
    finally:
        d.chmod(0o755)


@pytest.mark.parametrize("option", ["--json", "--report", "--log", "--dump-dir"])
def test_an_unwritable_output_fails_before_any_stage(readonly: Path, option: str) -> None:
    target = readonly / ("out.md" if option == "--report" else "out.csv" if option == "--log" else "out")
    if option == "--json":
        target = readonly / "out.json"
    r = runner.invoke(app, ["triage", HEALTHY, "--steps", "3", "--device", "cpu", option, str(target)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "not writable" in lines[0] and str(readonly) in lines[0], r.output
    assert "amp_misuse" not in r.output and "Traceback" not in r.output and "Stages" not in r.output


def test_two_outputs_on_one_path_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "same.json"
    r = runner.invoke(app, ["triage", HEALTHY, "--steps", "3", "--json", str(p), "--report", str(p)])
    assert r.exit_code == 2 and "--json and --report both name" in r.output


def test_json_dash_writes_json_to_stdout_and_the_rest_to_stderr() -> None:
    r = runner.invoke(app, ["triage", HEALTHY, "--steps", "3", "--device", "cpu", "--json", "-"])
    assert r.exit_code in (0, 1), r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"]["cause"] == "healthy"
    assert "Stages" in r.stderr and "ampdoctor verdict" in r.stderr and "report written to" not in r.stderr
    assert not Path("-").exists()


def test_square_brackets_in_paths_are_printed_as_they_are(tmp_path: Path) -> None:
    missing = tmp_path / "runs[/x]" / "[bold]steps.csv"
    r = runner.invoke(app, ["scaler", str(missing)])
    assert r.exit_code == 2 and str(missing) in r.output.replace("\n", ""), r.output
    folder = tmp_path / "runs[" / "x]"  # the path reads runs[/x]/: a closing tag to rich's markup
    folder.mkdir(parents=True)
    log = folder / "[red]steps.csv"
    log.write_text("step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"
                   "0,,1,1,1,0,,8\n1,,inf,inf,1,1,nonfinite_grad:layers[/0],8\n2,,1,1,1,0,,4\n")
    r = runner.invoke(app, ["scaler", str(log)])
    assert r.exit_code == 0, r.output
    assert str(log) in r.output and "nonfinite_grad:layers[/0]" in r.output


def _bracketed_report():  # type: ignore[no-untyped-def]
    rep = make_report()
    rep.verdict = replace(rep.verdict, first_module="layers[/0].c_attn")
    rep.layers = [replace(rep.layers[0], module="layers[/0].c_attn"), *rep.layers[1:]]
    rep.fixes = ["Keep [bold]layers[/0][/] in FP32."]
    return rep


def test_square_brackets_in_module_names_reach_the_terminal() -> None:
    buf = io.StringIO()
    render_terminal(_bracketed_report(), Console(file=buf, width=120, force_terminal=False))
    text = buf.getvalue()
    assert "first module: layers[/0].c_attn" in text and "Keep [bold]layers[/0][/] in FP32." in text


def test_markdown_keeps_underscores_brackets_and_model() -> None:
    rep = make_report()
    assert rep.scaler is not None
    rep.scaler.skips = [ScaleEvent(1, 2.0, "nonfinite_grad:transformer.h.0.attn.c_attn")]
    rep.verdict = replace(rep.verdict, summary="The output of <model> overflows at step 0.")
    rep.layers = [LayerRow("<model>", "activation", 9e4, 1.0, 0.0, 0.25, -0.46, 0)]
    text = md_render.render(rep)
    assert "1 × nonfinite grad at `transformer.h.0.attn.c_attn`" in text and "c attn" not in text
    assert "The output of \\<model\\> overflows" in text and "| `<model>` |" in text


# 80 columns and pipes ----------------------------------------------------------------------------


def _terminal(width: int) -> str:
    buf = io.StringIO()
    render_terminal(make_report(), Console(file=buf, width=width, force_terminal=False, color_system=None))
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def test_terminal_golden_at_80_columns_piped() -> None:
    text = _terminal(80)
    golden("terminal_80.txt", text)
    assert max(len(line) for line in text.splitlines()) <= 80
    # whole module names and whole numbers: no one-letter-per-line column, nothing cut with an ellipsis
    assert "encoder.layer1.weight" in text and "decoder.block5.mlp" in text and "9.021e+04" in text
    assert "…" not in text


def test_terminal_golden_wide() -> None:
    golden("terminal_120.txt", _terminal(120))


def test_layers_table_piped_at_80_columns(tmp_path: Path) -> None:
    from .conftest import write_spec
    from .test_layers import SPEC

    spec = write_spec(tmp_path, SPEC)
    r = runner.invoke(app, ["layers", str(spec), "--device", "cpu", "--steps", "1"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert max(len(x.rstrip()) for x in lines) <= 80
    assert "…" not in r.output
    assert any(x.split()[:1] and x.split()[0].endswith(".weight") for x in lines)
    assert any(x.split()[:1] and x.split()[0].endswith(".bias") for x in lines)


def test_plots_are_part_of_the_base_install() -> None:
    import tomllib

    from ampdoctor.render.html import render as render_html

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].strip() == "matplotlib" for d in deps)
    assert "data:image/png;base64," in render_html(make_report())  # the HTML report carries its plots by default
