"""The layers report as one self-contained HTML file: the triage report's CSS, tables and sections,
plots inline as base64 ``data:`` URIs, no scripts, nothing fetched from the network."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ampdoctor.render.common import scale
from ampdoctor.render.html import CSS, _table, e, environment_section, figure, reproduce_section, t
from ampdoctor.render.layers_markdown import HEAD, RIGHT, SORT_WORDS, TOP_ROWS, loss_scale_text, row_cells
from ampdoctor.report.layers_doc import is_bad, risk_order

COLORS = {"safe": "#1a7f37", "safe_with_scale": "#9a6700", "unsafe": "#cf222e", "fp32_nonfinite": "#cf222e"}


def _rows(rows: list[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    cells, classes = [], []
    for r in rows:
        c = [e(x) for x in row_cells(r)]
        c[0] = f"<code>{c[0]}</code>"
        cells.append(c)
        classes.append("bad" if is_bad(r) else "warn" if r["underflow_frac"] > 0 or r["subnormal_frac"] > 0 else "")
    return cells, classes


def _summary(doc: Mapping[str, Any]) -> str:
    rows, cls = [], []
    for f in doc["formats"]:
        rec = f["recommendation"]
        keep = ", ".join(f"<code>{e(k['module'])}</code>" for k in rec["keep_high"]) or "-"
        rows.append([f'<a href="#{e(f["dtype"])}">{e(f["dtype"])}</a>', e(rec["headline"].split(": ", 1)[-1]),
                     e(loss_scale_text(f)), keep])
        cls.append("" if rec["verdict"] == "safe" else "warn" if rec["verdict"] == "safe_with_scale" else "bad")
    return _table(["format", "verdict", "loss scale", "keep in higher precision"], rows, None, cls)


def _format(fmt: Mapping[str, Any], sort: str, images: Mapping[str, bytes], titles: Mapping[str, str],
            missing: str | None) -> str:
    d, rec, rows = fmt["dtype"], fmt["recommendation"], fmt["rows"]
    color = COLORS.get(rec["verdict"], "#cf222e")
    detail = f" <span class=\"muted\">{t(rec['detail'])}</span>" if rec["detail"] else ""
    items, depth = [], 0
    for a in rec["advice"]:  # nested lists for level-1 items
        lv = int(a["level"])
        while depth < lv:
            items.append("<ul>")
            depth += 1
        while depth > lv:
            items.append("</ul>")
            depth -= 1
        items.append(f"<li>{t(a['text'])}</li>")
    items += ["</ul>"] * depth
    advice = f"<ul>{''.join(items)}</ul>" if items else ""
    parts = [f'<h2 id="{e(d)}">{e(d)}</h2>',
             f'<section class="verdict" style="--c:{color}"><div class="cause">{e(rec["headline"])}</div>{detail}{advice}</section>']
    mine = {k: v for k, v in images.items() if k.startswith(f"{d}_")}
    if missing:
        parts.append(f'<p class="muted">No plots: {e(missing)}.</p>')
    elif mine:
        parts.append('<div class="plots two">' + "".join(figure(k, v, titles.get(k, k)) for k, v in mine.items()) + "</div>")
    if not rows:
        parts.append('<p class="muted">No tensor matched (see --filter and --what).</p>')
        return "".join(parts)
    scaled = f"gradients × {scale(fmt['grad_scale'])}" if fmt["grad_scale"] != 1.0 else "gradients unscaled"
    top = risk_order(rows)[:TOP_ROWS]
    cells, cls = _rows(top)
    parts.append(f"<p><b>Worst {len(top)} of {len(rows)} tensors</b> (NaN/Inf, then overflow, underflow, subnormal; "
                 f"{e(scaled)}):</p>" + _table(HEAD, cells, RIGHT, cls))
    if len(rows) > len(top):
        cells, cls = _rows(rows)
        parts.append(f"<details><summary>All {len(rows)} tensors ({e(d)}, {e(SORT_WORDS.get(sort, f'by {sort}, worst first'))})"
                     f"</summary>{_table(HEAD, cells, RIGHT, cls)}</details>")
    return "".join(parts)


def render(doc: Mapping[str, Any], images: Mapping[str, bytes] | None = None, *, missing_plots: str | None = None) -> str:
    """The HTML page. ``images`` maps plot names to PNG bytes; None draws them (with matplotlib) when possible."""
    from ampdoctor.render import layers_plots, plots

    if images is None and missing_plots is None:
        if plots.available():
            images = layers_plots.figures(dict(doc))
        else:
            missing_plots = plots.INSTALL_HINT
    titles = layers_plots.titles(dict(doc))
    sort = str(doc["config"].get("sort", "risk"))
    spec = doc["config"].get("spec")
    verdicts = ", ".join(f"{f['dtype']} {f['recommendation']['verdict']}" for f in doc["formats"])
    body = "".join([
        f'<h1>ampdoctor layers report <span class="muted">{e(spec) if spec else ""}</span></h1>', _summary(doc),
        *[_format(f, sort, images or {}, titles, missing_plots) for f in doc["formats"]],
        reproduce_section(doc.get("reproduce"), doc["environment"].get("command")),
        environment_section(doc["environment"], doc["config"]),
        f'<p class="muted"><small>{e(doc["tool"])} · report schema {e(doc["schema_version"])}</small></p>',
    ])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>ampdoctor layers: {e(verdicts)}</title>'
            f"<style>{CSS}</style></head><body><main>{body}</main></body></html>\n")
