"""The layers report in GitHub-flavoured Markdown, to paste into an issue or a ticket.

A verdict table first (one row per format), then per format: the verdict, the advice, the worst
tensors by severity and the full table folded into ``<details>``, the plots (PNG files beside
the Markdown file, linked relatively); then how to reproduce and the environment. Tables, cells,
the environment and reproduce sections are the triage report's (``render.markdown``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ampdoctor.render.common import num, pct, scale
from ampdoctor.render.markdown import (
    _headroom,
    assets_dir,
    cell,
    code,
    environment_section,
    image_lines,
    reproduce_section,
    table,
)
from ampdoctor.report.layers_doc import KIND_LABEL, is_bad, risk_order, window_text

TOP_ROWS = 10
"""Rows of the by-severity table; the full table folds into <details>."""

ICONS = {"safe": "✅", "safe_with_scale": "⚠️", "unsafe": "❌", "fp32_nonfinite": "❌"}
HEAD = ["tensor", "kind", "absmax", "min≠0", "overflow", "underflow", "subnormal", "NaN/Inf", "headroom", "window"]
RIGHT = {2, 3, 4, 5, 6, 7, 8, 9}
SORT_WORDS = {"risk": "worst first", "order": "in forward order"}


def loss_scale_text(fmt: Mapping[str, Any]) -> str:
    ls = fmt["recommendation"].get("loss_scale")
    if not ls or ls.get("init_scale") is None:
        return "-"
    if fmt["dtype"] == "bf16" and ls["init_scale"] == 1.0:
        return "none needed"
    return scale(ls["init_scale"])


def row_cells(r: Mapping[str, Any]) -> list[str]:
    """One table row as text cells (shared with the HTML renderer, which escapes them)."""
    return [r["tensor"], KIND_LABEL.get(r["kind"], r["kind"]), num(r["absmax"]), num(r["min_nonzero"]),
            pct(r["overflow_frac"]), pct(r["underflow_frac"]), pct(r["subnormal_frac"]), pct(r["nonfinite_frac"]),
            _headroom(r["headroom_binades"]), window_text(r)]


def _md_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        c = row_cells(r)
        c[0] = code(c[0])
        if is_bad(r):
            c[0] = f"❌ {c[0]}"
        out.append(c)
    return out


def _summary(doc: Mapping[str, Any]) -> list[str]:
    rows = []
    for f in doc["formats"]:
        rec = f["recommendation"]
        keep = ", ".join(code(k["module"]) for k in rec["keep_high"]) or "-"
        rows.append([f"[{f['dtype']}](#{f['dtype']})", f"{ICONS.get(rec['verdict'], '')} {rec['headline'].split(': ', 1)[-1]}",
                     loss_scale_text(f), keep])
    spec = doc["config"].get("spec")
    lines = [f"# ampdoctor layers report{f': {code(Path(str(spec)).name)}' if spec else ''}", ""]
    lines += table(["format", "verdict", "loss scale", "keep in higher precision"], rows)
    steps = max((f["steps"] for f in doc["formats"]), default=0)
    lines += ["", f"Per tensor (module output `act`, the gradient at it `∂act`, parameter `param`, its gradient `∂param`): "
                  f"what casting it to the format would do, the worst value over {steps} FP32 reference step(s). Gradients "
                  "are multiplied by the loss scale before the cast test; *window* is the range of loss scales a gradient "
                  "takes without overflow and with underflow within the tolerance; *headroom* is log2(format max / absmax) "
                  "in binades (below 0 overflows)."]
    return lines


def _advice(rec: Mapping[str, Any]) -> list[str]:
    icon = ICONS.get(rec["verdict"], "")
    detail = f": {rec['detail']}" if rec["detail"] else ""
    lines = [f"> {icon} **{cell(rec['headline'])}**{cell(detail)}"]
    if rec["advice"]:
        lines.append("")
        lines += [f"{'  ' * int(a['level'])}- {cell(a['text'])}" for a in rec["advice"]]
    return lines


def _format(fmt: Mapping[str, Any], sort: str, images: Mapping[str, str], titles: Mapping[str, str],
            missing: str | None) -> list[str]:
    d = fmt["dtype"]
    rec = fmt["recommendation"]
    rows = fmt["rows"]
    lines = ["", f"## {d}", "", *_advice(rec)]
    if not rows:
        return [*lines, "", "_No tensor matched (see `--filter` and `--what`)._"]
    scaled = f"gradients × {scale(fmt['grad_scale'])}" if fmt["grad_scale"] != 1.0 else "gradients unscaled"
    top = risk_order(rows)[:TOP_ROWS]
    lines += ["", f"**Worst {len(top)} of {len(rows)} tensors** (NaN/Inf, then overflow, underflow, subnormal; {scaled}):", ""]
    lines += table(HEAD, _md_rows(top), RIGHT)
    if len(rows) > len(top):
        lines += ["", f"<details><summary>All {len(rows)} tensors ({d}, {SORT_WORDS.get(sort, f'by {sort}, worst first')})"
                      "</summary>", "", *table(HEAD, _md_rows(rows), RIGHT), "", "</details>"]
    mine = {k: v for k, v in images.items() if k.startswith(f"{d}_")}
    if missing:
        lines += ["", f"_No plots: {missing}._"]
    elif mine:
        lines += ["", *image_lines(mine, titles)]
    return lines


def render(doc: Mapping[str, Any], images: Mapping[str, str] | None = None, *, missing_plots: str | None = None) -> str:
    """The Markdown text. ``images`` maps plot names to (relative) links; ``missing_plots`` says why there are none."""
    from ampdoctor.render.layers_plots import titles

    caps = titles(dict(doc))
    sort = str(doc["config"].get("sort", "risk"))
    lines = _summary(doc)
    for f in doc["formats"]:
        lines += _format(f, sort, images or {}, caps, missing_plots)
    ran = doc["environment"].get("command")
    lines += reproduce_section(doc.get("reproduce"), ran)
    lines += environment_section(doc["environment"], doc["config"])
    lines += ["", f"<sub>{doc['tool']} · report schema {doc['schema_version']}</sub>", ""]
    return "\n".join(lines)


def outputs(doc: Mapping[str, Any], path: str | Path) -> dict[Path, str | bytes]:
    """Every file of a Markdown layers report at ``path``: the text and, with matplotlib, the PNGs in ``NAME_files/``."""
    from ampdoctor.render import layers_plots, plots

    p = Path(path)
    if not plots.available():
        return {p: render(doc, missing_plots=plots.INSTALL_HINT)}
    files: dict[Path, str | bytes] = {}
    folder = assets_dir(p)
    links = {}
    for name, png in layers_plots.figures(dict(doc)).items():
        files[folder / f"{name}.png"] = png
        links[name] = f"{folder.name}/{name}.png"
    files[p] = render(doc, links)
    return files
