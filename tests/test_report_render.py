"""Renderers against golden files built from hand-made Reports; every cause in every format."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ampdoctor.render import html as html_render
from ampdoctor.render import json as json_render
from ampdoctor.render import markdown as md_render
from ampdoctor.render import terminal as term_render
from ampdoctor.report.model import CAUSES, LayerStep, Report
from tests.report_fixtures import make_report

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("AMPDOCTOR_UPDATE_GOLDEN") == "1"
"""AMPDOCTOR_UPDATE_GOLDEN=1 python -m pytest tests/test_report_render.py rewrites the golden files."""

IMAGES = {"loss": "report_files/loss.png", "scale": "report_files/scale.png", "heatmap": "report_files/heatmap.png",
          "headroom": "report_files/headroom.png"}


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} missing; run with AMPDOCTOR_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{name} differs from the golden file; rerun with AMPDOCTOR_UPDATE_GOLDEN=1 if intended"


def test_markdown_golden() -> None:
    golden("forward_overflow.md", md_render.render(make_report(), IMAGES))


def test_markdown_golden_without_matplotlib() -> None:
    golden("healthy_noplots.md", md_render.render(make_report("healthy"), missing_plots="plots need matplotlib"))


def test_json_golden_and_round_trip() -> None:
    text = json_render.render(make_report())
    golden("forward_overflow.json", text)
    back = Report.from_dict(json.loads(text))
    assert json_render.render(back) == text
    assert back.layer_steps and back.layer_steps[0].module == "encoder.attn"


def test_markdown_reader_can_tell_what_where_when_and_what_to_try() -> None:
    text = md_render.render(make_report(), IMAGES)
    head = text.split("## Stages")[0]
    assert "FP16 forward overflow" in head and "`encoder.attn`" in head and "| First bad step | 0 |" in head
    assert "## What to change" in head and "1. Keep `encoder.attn` in FP32." in head
    assert "Hand-made verdict for fp16_forward_overflow \\| with a pipe." not in head  # a quote, not a table cell
    assert "--seed 7" in text and "--max-norm 1" in text and "--device cuda:0" in text
    assert "| CUDA | 12.4 |" in text and "| compute capability | 8.0 |" in text and "| TF32 cuDNN | yes |" in text
    assert "<details><summary>All 8 layers</summary>" in text
    for href in IMAGES.values():
        assert f"]({href})" in text


@pytest.mark.parametrize("cause", CAUSES)
def test_every_cause_renders_in_every_format(cause: str) -> None:
    report = make_report(cause)
    md = md_render.render(report, {})
    assert f"`{cause}`" in md and "## Environment" in md
    assert json.loads(json_render.render(report))["verdict"]["cause"] == cause
    page = html_render.render(report, {})
    assert page.startswith("<!DOCTYPE html>") and cause in page and "</html>" in page
    con = Console(record=True, width=120)
    term_render.render(report, con)
    assert con.export_text()


def test_html_is_self_contained() -> None:
    page = html_render.render(make_report(), {"loss": b"\x89PNG fake"})
    assert "data:image/png;base64," in page
    for bad in ("http://", "https://", "<script", "<link"):
        assert bad not in page


def test_markdown_outputs_put_plots_beside_the_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    files = md_render.outputs(make_report(), tmp_path / "bug.md")
    pngs = sorted(p.name for p in files if p.suffix == ".png")
    assert pngs == ["headroom.png", "heatmap.png", "loss.png", "scale.png"]
    assert all(p.parent == tmp_path / "bug_files" for p in files if p.suffix == ".png")
    text = files[tmp_path / "bug.md"]
    assert isinstance(text, str) and "](bug_files/heatmap.png)" in text
    assert all(isinstance(files[p], bytes) and files[p][:4] == b"\x89PNG" for p in files if p.suffix == ".png")


def test_markdown_without_matplotlib_says_how_to_get_plots(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ampdoctor.render import plots

    monkeypatch.setattr(plots, "available", lambda: False)
    files = md_render.outputs(make_report(), tmp_path / "r.md")
    assert list(files) == [tmp_path / "r.md"]
    assert "pip install matplotlib" in str(files[tmp_path / "r.md"])
    page = html_render.render(make_report())
    assert "pip install matplotlib" in page and "data:image" not in page


def test_heatmap_shows_the_verdicts_op_row_on_a_log_scale() -> None:
    """The op the verdict names (a layers row of kind 'op', not a heatmap row) is drawn, and a 0.2% share is
    not blank: the op row's pixels at its step are coloured."""
    pytest.importorskip("matplotlib")
    import io

    from matplotlib import image as mpimg

    from ampdoctor.records import LayerRow
    from ampdoctor.render.plots import heatmap_figure

    r = make_report()
    r.layer_steps = [LayerStep("enc", "activation", s, 0.0, 0.0, 0.0, 0.0, 10.0) for s in range(4)]
    r.layers = [LayerRow("enc > matmul", "op", 7.571e4, 0.002, 0.0, 0.0, -0.2, 0)]
    r.verdict.first_module, r.verdict.first_step = "enc", 0
    with_op = heatmap_figure(r)
    r.layers = []
    without = heatmap_figure(r)
    assert with_op is not None and without is not None
    a, b = mpimg.imread(io.BytesIO(with_op)), mpimg.imread(io.BytesIO(without))
    # the op row adds warm (red-orange) pixels: the 0.2% overflow cell and the red mark
    def warm(img: Any) -> int:
        return int(((img[..., 0] > 0.8) & (img[..., 1] < 0.6) & (img[..., 2] < 0.5)).sum())
    assert warm(a) > warm(b) + 50
