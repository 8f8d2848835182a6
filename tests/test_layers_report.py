"""`ampdoctor layers --report`: golden Markdown from a hand-made table, every format end to end, the JSON
Schema, --force and atomic writes, and the HTML report opened in headless Chromium."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from typer.testing import CliRunner

from ampdoctor.cli import reports as cli_report
from ampdoctor.cli.app import app
from ampdoctor.engine.layers import COLUMNS
from ampdoctor.errors import OutputError
from ampdoctor.render import layers_html, layers_markdown
from ampdoctor.report.layers_doc import build, to_json

from .conftest import write_spec
from .test_report_render import golden

runner = CliRunner()
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
MAX = {"fp16": 65504.0, "bf16": 3.3895313892515355e38}

ENV: dict[str, Any] = {
    "ampdoctor": "0.0.0", "torch": "2.99.0", "python": "3.11.0", "os": "Linux 6.0 (x86_64)", "cuda": "12.4",
    "device": "cuda:0", "command": "ampdoctor layers model.py --dtype fp16,bf16 --seed 7 --report bug.md",
    "device_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "fp16_supported": True, "bf16_supported": True,
    "tf32_matmul": False, "tf32_cudnn": True,
}
CONFIG: dict[str, Any] = {
    "spec": "model.py", "dtype": ["fp16", "bf16"], "steps": 2, "scale": 1.0, "what": ["activations", "grads", "weights"],
    "sort": "risk", "top": 40, "filter": None, "underflow_tolerance": 0.01, "device": "auto", "seed": 7,
    "model_fn": "build_model", "data_fn": "build_dataloader", "loss_fn": "loss_fn", "optimizer_fn": "build_optimizer",
    "csv": None, "parquet": None,
}
IMAGES = {"fp16_headroom": "bug_files/fp16_headroom.png", "fp16_fractions": "bug_files/fp16_fractions.png",
          "bf16_headroom": "bug_files/bf16_headroom.png"}

SPEC = (Path(__file__).parent / "assets" / "gain_spec.py").read_text()


def _row(module: str, kind: str, param: str, dtype: str, step: int, order: int, absmax: float, *, over: float = 0.0,
         under: float = 0.0, sub: float = 0.0, window: tuple[float, float] = (math.nan, math.nan)) -> dict[str, Any]:
    return {"module": module, "kind": kind, "param": param, "dtype": dtype, "scale": 1.0, "step": step, "numel": 256,
            "absmax": absmax * (1 + step / 8), "min_nonzero": absmax * 1e-6, "overflow_frac": over, "underflow_frac": under,
            "subnormal_frac": sub, "nonfinite_frac": 0.0, "headroom_binades": math.log2(MAX[dtype] / (absmax * (1 + step / 8))),
            "min_scale": window[0], "max_scale": window[1], "zero_frac": 0.0, "nan_frac": 0.0, "inf_frac": 0.0, "order": order}


def hand_made() -> pd.DataFrame:
    """A deterministic layer_stats table: blocks.1.attn's output overflows FP16, blocks.0.mlp's underflows; BF16 is fine."""
    rows = []
    mods = ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "head"]
    for step in (0, 1):
        for dtype in ("fp16", "bf16"):
            fp16 = dtype == "fp16"
            for i, m in enumerate(mods):
                big = m == "blocks.1.attn"
                rows.append(_row(m, "act", "output", dtype, step, i, 1.2e5 if big else 3.0 * (i + 1),
                                 over=0.125 if fp16 and big else 0.0, under=0.02 if fp16 and m == "blocks.0.mlp" else 0.0))
                win = (2.0**-4, 2.0 ** (14 - i)) if fp16 else (0.0, 2.0**120)
                rows.append(_row(m, "act_grad", "output", dtype, step, i, 0.5 * (i + 1), sub=0.01 * i if fp16 else 0.0,
                                 window=win))
            rows.append(_row("head", "param", "weight", dtype, step, 5, 0.2))
            rows.append(_row("head", "param_grad", "weight", dtype, step, 5, 40.0, sub=0.05 if fp16 else 0.0,
                             window=(2.0**2, 2.0**10) if fp16 else (0.0, 2.0**121)))
    return pd.DataFrame.from_records(rows, columns=COLUMNS)


def doc() -> dict[str, Any]:
    return build(hand_made(), CONFIG, ENV)


def schema() -> dict[str, Any]:
    return json.loads(resources.files("ampdoctor").joinpath("schema/layers.schema.json").read_text())


def validate(d: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema()).validate(d)


def invoke(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, ["layers", *args, "--device", "cpu"], env={"COLUMNS": "100"})
    return r.exit_code, r.output


# rendering from a hand-made table ------------------------------------------------------------------


def test_markdown_golden() -> None:
    golden("layers_report.md", layers_markdown.render(doc(), IMAGES))


def test_markdown_reader_can_tell_what_is_unsafe_where_and_what_to_do() -> None:
    text = layers_markdown.render(doc(), IMAGES)
    head = text.split("## fp16")[0]
    assert "| [fp16](#fp16) | ❌ not safe as is | 2^9 | `blocks.1.attn`, `blocks.0.mlp` |" in head
    assert "| [bf16](#bf16) | ✅ safe for this model as is | none needed | - |" in head
    fp16 = text.split("## fp16")[1].split("## bf16")[0]
    assert "- keep in higher precision (FP32, or autocast(enabled=False)):" in fp16
    assert "  - blocks.1.attn: output overflow fp16" in fp16 and "GradScaler(init_scale=512), 2^9," in fp16
    top = fp16.split("<details>")[0]
    assert top.index("❌ `blocks.1.attn`") < top.index("`blocks.0.mlp`"), "the top table is by severity"
    assert "<details><summary>All 14 tensors (fp16, worst first)</summary>" in fp16
    assert "--seed 7" in text and "--device cuda:0" in text and ENV["command"] in text
    assert "| compute capability | 8.0 |" in text and "| TF32 cuDNN | yes |" in text
    for href in IMAGES.values():
        assert f"]({href})" in text


def test_json_document_validates_and_round_trips() -> None:
    d = json.loads(to_json(doc()))
    validate(d)
    assert d["schema_version"] == 1 and d["tool"] == "ampdoctor layers" and d["config"] == CONFIG
    fp16 = d["formats"][0]
    assert fp16["recommendation"]["verdict"] == "unsafe" and fp16["recommendation"]["bf16_fixes"] is True
    assert [k["module"] for k in fp16["recommendation"]["keep_high"]] == ["blocks.1.attn", "blocks.0.mlp"]
    assert fp16["rows"][0]["tensor"] == "blocks.1.attn" and fp16["rows"][0]["overflow_frac"] == 0.125
    bf16_grads = [r for r in d["formats"][1]["rows"] if r["kind"] == "param_grad"]
    assert bf16_grads[0]["max_scale"] == 2.0**121 and bf16_grads[0]["min_scale"] == 0.0
    assert any(r["min_scale"] is None for r in fp16["rows"]), "no window for activations and weights"


def test_schema_is_valid_draft_2020_12() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema())


def test_html_is_self_contained() -> None:
    page = layers_html.render(doc(), {"fp16_headroom": b"\x89PNG fake"})
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64," in page and "not safe as is" in page
    for bad in ("http://", "https://", "<script", "<link"):
        assert bad not in page


def test_without_matplotlib_the_reports_say_how_to_get_plots(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ampdoctor.render import plots

    monkeypatch.setattr(plots, "available", lambda: False)
    files = layers_markdown.outputs(doc(), tmp_path / "r.md")
    assert list(files) == [tmp_path / "r.md"] and "pip install matplotlib" in str(files[tmp_path / "r.md"])
    page = layers_html.render(doc())
    assert "pip install matplotlib" in page and "data:image" not in page


# the command, end to end -----------------------------------------------------------------------------


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path, SPEC)


def test_markdown_report_with_pngs_beside_it(spec: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    md = tmp_path / "bug.md"
    code, text = invoke(str(spec), "--dtype", "fp16,bf16", "--steps", "2", "--report", str(md))
    assert code == 0, text
    assert "fp16: not safe as is" in text and "big: output overflow fp16" in text
    assert f"report written to {md}" in " ".join(text.split())  # (a long temporary path may wrap)
    assert max(len(line) for line in text.splitlines()) <= 100
    report = md.read_text()
    assert "| [fp16](#fp16) | ❌ not safe as is |" in report and "`big`" in report and "--steps 2" in report
    pngs = sorted(p.name for p in (tmp_path / "bug_files").iterdir())
    assert pngs == ["bf16_headroom.png", "fp16_fractions.png", "fp16_headroom.png"]
    assert all(f"](bug_files/{p})" in report for p in pngs)
    assert all((tmp_path / "bug_files" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_json_report_of_a_sample_model_validates(samples: Path, tmp_path: Path) -> None:
    out = tmp_path / "layers.json"
    code, text = invoke(str(samples / "forward_overflow.py"), "--dtype", "fp16,bf16", "--steps", "2", "--scale", "auto",
                        "--filter", "blocks", "--report", str(out))
    assert code == 0, text
    d = json.loads(out.read_text())
    validate(d)
    assert d["config"]["scale"] == "auto" and d["config"]["filter"] == "blocks" and d["environment"]["device"] == "cpu"
    assert "--scale auto" in d["reproduce"] and "--filter blocks" in d["reproduce"]
    assert all(r["module"].startswith("blocks") for f in d["formats"] for r in f["rows"])
    assert d["formats"][0]["grad_scale"] == d["formats"][0]["recommendation"]["loss_scale"]["init_scale"]


def test_html_report_end_to_end(spec: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.html"
    code, text = invoke(str(spec), "--steps", "1", "--what", "activations", "--report", str(out))
    assert code == 0, text
    page = out.read_text()
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', page)) == 2  # fp16 headroom and fractions
    assert "http://" not in page and "https://" not in page


def test_existing_report_or_png_folder_is_refused_before_anything_runs(tmp_path: Path, spec: Path) -> None:
    never = write_spec(tmp_path, f"open({str(tmp_path / 'ran')!r}, 'w').close()\ndef build_model(): ...\n"
                                 "def build_dataloader(): ...\n", "never.py")
    old = tmp_path / "r.json"
    old.write_text("old")
    code, text = invoke(str(never), "--report", str(old))
    assert code == 2 and "--force" in text and old.read_text() == "old" and not (tmp_path / "ran").exists()
    (tmp_path / "m_files").mkdir()
    (tmp_path / "m_files" / "fp16_headroom.png").write_bytes(b"old")
    code, text = invoke(str(never), "--report", str(tmp_path / "m.md"))
    assert code == 2 and "m_files" in text and not (tmp_path / "ran").exists()
    code, text = invoke(str(spec), "--steps", "1", "--what", "weights", "--report", str(old), "--force")
    assert code == 0, text
    assert json.loads(old.read_text())["tool"] == "ampdoctor layers"


@pytest.mark.parametrize(("args", "message"), [
    (["--report", "r.pdf"], "unknown extension '.pdf'; use .md, .json or .html"),
    (["--report", "same.csv", "--csv", "same.csv"], "--report names the same file as --csv"),
    (["--report", "nowhere/r.md"], "does not exist"),
])
def test_bad_report_paths_are_one_line_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    args = [str(tmp_path / a) if a.startswith(("r.", "same", "nowhere")) else a for a in args]
    code, text = invoke(str(tmp_path / "missing.py"), *args)
    assert code == 2 and message in " ".join(text.split()) and len(text.strip().splitlines()) == 1, text


def test_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "r.html"
    path.write_text("old")

    def crash(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OutputError, match="cannot write .*r\\.(html|json): disk full"):
        cli_report.write_layers_report(path, doc())
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.html"]


# the HTML report in a browser -----------------------------------------------------------------------


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium; .ci/run does)")
def test_html_report_renders_in_headless_chromium_with_a_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    page = tmp_path / "layers.html"
    cli_report.write_layers_report(page, doc())
    assert CHROMIUM is not None
    res = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=60)
    dom = res.stdout
    assert "fp16: not safe as is" in dom, f"the page did not render: {res.stderr[-500:]}"
    imgs = re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)
    assert len(imgs) == 3, "expected fp16 headroom and fractions, bf16 headroom"
    assert all(len(b) > 5000 for b in imgs), "a plot is suspiciously small"
