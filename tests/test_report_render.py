"""Renderers against golden files built from hand-made Reports; every cause in every format."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
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
    assert "FP16 forward overflow" in head and "`encoder.attn`" in head and "| `encoder.attn` | 0 | amp |" in head
    # the title says what ran, not "ampdoctor report ampdoctor triage"
    assert head.startswith("# FP16 forward overflow in model_spec.py\n\nampdoctor triage of model_spec.py: the amp stage")
    assert "|  |  |\n|---|---|" not in text  # no table with an empty header row
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
    # the op row's 0.2% overflow cell is drawn in the colour of 0.2% (the heatmap holds no other share that size)
    from ampdoctor.render.plots import heat_colors

    cmap, norm = heat_colors()
    want = np.array(cmap(norm(0.002))[:3])

    def cell(img: Any) -> int:
        return int((np.abs(img[..., :3] - want).max(axis=-1) < 0.03).sum())
    assert cell(a) > cell(b) + 1000  # (the colour bar holds the colour too)
    # and the smallest share drawn is not white: a 1e-4 cell stands out from a 0
    assert min(cmap(norm(1e-4))[:3]) < 0.9


def test_evidence_reads_as_sentences_with_units() -> None:
    """No key=value dump: the facts as sentences, FP16's max as 65504, the headroom in binades, shares in %."""
    from ampdoctor.report.words.evidence import evidence

    ev = {"fp32_recheck_loss": 43.81, "fp32_recheck_finite": True, "fp32_recheck_weights": "stage amp before step 0",
          "op": "matmul", "op_overflow_frac": 0.001953, "fp32_absmax": 75710.0, "fp16_max": 65504.0}
    said = evidence(ev, "blocks.1.attn")
    assert said == ["The `matmul` op in blocks.1.attn reaches 7.571e+04 in FP32, 1.16 times FP16's largest value 65504 "
                    "(headroom -0.21 binades); 0.2% of its elements overflow FP16.",
                    "Re-run in FP32 from the same weights (stage amp before step 0), the step stays finite (loss 43.81)."]
    # a fact no sentence knows is kept, as words
    assert evidence({"new_fact": 3}) == ["new fact: 3."]
    md = md_render.render(make_report(), IMAGES)
    page = html_render.render(make_report(), {})
    for text in (md, page):
        assert "fp16_max=" not in text and "fp32_absmax=" not in text
        assert "1.38 times FP16&#x27;s largest value 65504" in text or "1.38 times FP16's largest value 65504" in text


def test_markdown_carries_its_pictures_as_text() -> None:
    """A ticket paste without the PNGs still shows the shape: headroom per layer and the scale over the steps,
    the verdict's rows and step marked."""
    md = md_render.render(make_report(), missing_plots="plots need matplotlib")
    chart = md.split("## Plots")[1].split("```text\n")[1].split("```")[0].splitlines()
    over = next(line for line in chart if line.startswith("encoder.attn [activation]"))
    assert "-0.5 ✗ overflows FP16" in over and over.endswith("◀ verdict")
    bars = [line for line in chart if "█" in line and "[" in line]
    assert len(bars) >= 5 and not any(line.endswith("◀ verdict") for line in bars)  # only the verdict's rows
    i = chart.index(next(line for line in chart if line.startswith("GradScaler scale, steps 0-11")))
    assert chart[i].endswith("top 2^16, bottom 2^11")
    assert chart[i + 5].strip() == "▲××××" and chart[i + 6] == "× skipped (0-4), ▲ the verdict's step 0"
    # the scale's columns fall from the top row at step 0 to the bottom row from step 5 on
    assert chart[i + 1].split(" ", 1)[1].startswith("█") and chart[i + 4].split(" ", 1)[1].endswith("▁▁▁▁▁▁▁")


def test_environment_names_the_cpu_model(tmp_path: Path) -> None:
    from ampdoctor.input.env import cpu_name

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7763 64-Core Processor\n")
    assert cpu_name(str(info)) == "AMD EPYC 7763 64-Core Processor"
    assert cpu_name(str(tmp_path / "missing")) != ""  # platform.processor(), or the architecture
    page = html_render.render(make_report(), {})
    env = page.split("<h2>Environment</h2>")[1]
    assert env.startswith("<table><tbody>")  # no empty header row
    assert "<h1>FP16 forward overflow <span class=\"muted\">model_spec.py</span></h1>" in page


def test_a_replays_scaler_story_names_the_step_log_only_when_there_is_one() -> None:
    from ampdoctor.report.words import run as run_words

    assert run_words.replay_scaler(65536.0, 1, {"step_log": "run/steps.csv"}).endswith("`ampdoctor scaler run/steps.csv`.")
    none = run_words.replay_scaler(65536.0, 1, {"step_log": None})
    assert "steps.csv`" not in none and "kept no step log" in none and "2^16" in none
    old = run_words.replay_scaler(65536.0, 1, {})  # a capture from before the manifest had the field
    assert "If the run kept a step log" in old and "ampdoctor scaler steps.csv" not in old
