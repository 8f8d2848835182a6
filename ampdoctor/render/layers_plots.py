"""PNG figures of a layers report (matplotlib Agg, a base dependency), per format.

``figures(doc)`` returns ``{name: png_bytes}``: ``{dtype}_headroom`` (binades between each
tensor's absmax and the format's max, the tightest tensors first) and ``{dtype}_fractions``
(overflow / underflow / subnormal / NaN-Inf shares of the tensors that have any). The ops inside
modules that overflow the format (``recommendation.inner_ops``) are rows too, and every row of a
module the advice keeps in higher precision is marked (red bold label, outlined bar). Every panel
of a document has one size and one font size, and a legend for each colour. Uses the triage plots'
backend setup and PNG writer (no metadata: the same data gives the same bytes). Nothing here
prints or touches files.
"""

from __future__ import annotations

import math
from typing import Any

from ampdoctor.formats import get_format
from ampdoctor.render.common import scale
from ampdoctor.render.plots import CULPRIT, _plt, _png, below_zero_marker, mark_below_zero
from ampdoctor.report.layers_doc import KIND_LABEL, risk_order

MAX_BARS = 30
"""Tensors per figure: the tightest / worst ones."""
FONT = 8
"""The one font size of every label, tick and legend of the layers panels."""
WIDTH = 7.5
"""Inches: every panel is this wide."""

_FRACTIONS = (("overflow_frac", "overflow", "#d62728"), ("underflow_frac", "underflow to 0", "#1f77b4"),
              ("subnormal_frac", "subnormal", "#ff7f0e"), ("nonfinite_frac", "NaN/Inf in FP32", "#222222"))
_HEADROOM = (("#d62728", "below 0: overflows"), ("#ff7f0e", "under 2 binades: thin"), ("#2ca02c", "2 binades or more"))


def titles(doc: dict[str, Any]) -> dict[str, str]:
    """Plot name → caption, for every plot the document can have."""
    out = {}
    for f in doc["formats"]:
        d = f["dtype"]
        out[f"{d}_headroom"] = f"{d}: headroom per tensor (binades below the format's max)"
        out[f"{d}_fractions"] = f"{d}: overflow, underflow and subnormal shares per tensor"
    return out


def _label(row: dict[str, Any]) -> str:
    name = row["tensor"]
    return f"{name if len(name) <= 34 else '…' + name[-33:]} [{KIND_LABEL.get(row['kind'], row['kind'])}]"


def _op_rows(fmt: dict[str, Any]) -> list[dict[str, Any]]:
    """The ops inside modules that overflow the format, as rows the plots draw like tensors."""
    f = get_format(fmt["dtype"])
    out = []
    for o in fmt["recommendation"].get("inner_ops") or []:
        out.append({"tensor": f"{o['module']} > {o['op']}", "kind": "op", "module": o["module"],
                    "headroom_binades": math.log2(f.max / o["absmax"]) if o["absmax"] > 0 else math.inf,
                    "overflow_frac": o.get("overflow_frac", 0.0), "underflow_frac": 0.0, "subnormal_frac": 0.0,
                    "nonfinite_frac": 0.0})
    return out


def _culprits(fmt: dict[str, Any]) -> set[str]:
    """The modules the advice keeps in higher precision: the rows every panel marks."""
    return {k["module"] for k in fmt["recommendation"].get("keep_high") or []}


def _mine(row: dict[str, Any], culprits: set[str]) -> bool:
    return row.get("module") in culprits


def _headroom_rows(fmt: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [r for r in [*_op_rows(fmt), *fmt["rows"]] if math.isfinite(r["headroom_binades"])]
    return sorted(rows, key=lambda r: r["headroom_binades"])[:MAX_BARS]


def _fraction_rows(fmt: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [*_op_rows(fmt), *risk_order(fmt["rows"])]
    return [r for r in rows if any(r[k] > 0 for k, _, _ in _FRACTIONS)][:MAX_BARS]


def _rows_per_panel(doc: dict[str, Any]) -> int:
    """One row count for every panel of the document (its longest panel's): one height, one bar thickness."""
    return max([len(_headroom_rows(f)) for f in doc["formats"]] + [len(_fraction_rows(f)) for f in doc["formats"]] + [4])


def _height(n: int) -> float:
    return 0.26 * n + 1.6


def _mark(ax: Any, rows: list[dict[str, Any]], culprits: set[str]) -> bool:
    """Red bold labels for the culprit rows; whether there was one."""
    marked = False
    for lab, r in zip(ax.get_yticklabels(), rows, strict=True):
        if _mine(r, culprits):
            lab.set_color(CULPRIT)
            lab.set_fontweight("bold")
            marked = True
    return marked


def headroom_figure(fmt: dict[str, Any], n: int = 0) -> bytes | None:
    """``n``: the rows every panel makes room for (at least this panel's)."""
    rows = _headroom_rows(fmt)
    if not rows:
        return None
    from matplotlib.patches import Patch

    culprits = _culprits(fmt)
    fig, ax = _panel(len(rows), n)
    hs = [r["headroom_binades"] for r in rows]
    colors = ["#d62728" if h < 0 else "#ff7f0e" if h < 2 else "#2ca02c" for h in hs]
    mine = [_mine(r, culprits) for r in rows]
    ax.barh(range(len(rows)), hs, color=colors, edgecolor=["black" if m else "none" for m in mine], linewidth=1.2)
    _row_labels(ax, rows, n)
    ax.axvline(0, color="black", linewidth=1)
    marked = mark_below_zero(ax, hs, fontsize=FONT)  # a slightly negative bar: a marker and its value, not a sliver
    scaled = f", gradients x {scale(fmt['grad_scale'])}" if fmt["grad_scale"] != 1.0 else ""
    ax.set_xlabel(f"headroom in binades: log2({fmt['dtype']} max / absmax){scaled}; below 0 overflows", fontsize=FONT)
    more = f" (tightest {len(rows)} of {len(fmt['rows'])})" if len(fmt["rows"]) > len(rows) else ""
    ax.set_title(f"{fmt['dtype']}: headroom per tensor{more}", fontsize=FONT + 1)
    ax.grid(axis="x", alpha=0.3)
    items: list[Any] = [Patch(color=c, label=lab) for c, lab in _HEADROOM] + ([below_zero_marker()] if marked else [])
    if _mark(ax, rows, culprits):
        items.append(Patch(facecolor="white", edgecolor="black", label="red label, outlined: keep in higher precision"))
    ax.legend(handles=items, fontsize=FONT, loc="upper right", framealpha=0.9)  # beside the shortest bars
    return _png(fig, tight=False)


def _panel(rows: int, n: int) -> tuple[Any, Any]:
    """A figure of one panel sized for ``n`` rows (at least ``rows``): every panel of a document has one size."""
    return _plt().subplots(figsize=(WIDTH, _height(max(n, rows))), layout="constrained")


def _row_labels(ax: Any, rows: list[dict[str, Any]], n: int) -> None:
    """One tick a row, labelled with its tensor, the rows filling from the top of a panel made for ``n``."""
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_label(r) for r in rows], fontsize=FONT)
    ax.tick_params(axis="x", labelsize=FONT)
    # the bottom of the y axis: rows fill from the top, whatever their count (one panel size for all)
    ax.set_ylim(max(n, len(rows), 1) - 0.4, -0.6)


def fractions_figure(fmt: dict[str, Any], n: int = 0) -> bytes | None:
    """``n``: the rows every panel makes room for (at least this panel's)."""
    rows = _fraction_rows(fmt)
    if not rows:
        return None
    import numpy as np

    culprits = _culprits(fmt)
    fig, ax = _panel(len(rows), n)
    y = np.arange(len(rows))
    h = 0.8 / len(_FRACTIONS)
    for i, (key, label, color) in enumerate(_FRACTIONS):
        ax.barh(y + (i - 1.5) * h, [100 * r[key] for r in rows], height=h, color=color, label=label)
    _row_labels(ax, rows, n)
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlim(left=0)
    ax.set_xlabel("% of elements (worst step)", fontsize=FONT)
    ax.set_title(f"{fmt['dtype']}: overflow, underflow and subnormal shares", fontsize=FONT + 1)
    ax.grid(axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if _mark(ax, rows, culprits):
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="white", edgecolor=CULPRIT, label="red label: keep in higher precision"))
        labels.append("red label: keep in higher precision")
    ax.legend(handles, labels, fontsize=FONT, loc="lower right", framealpha=0.9)
    return _png(fig, tight=False)


def figures(doc: dict[str, Any]) -> dict[str, bytes]:
    """Every plot the document has data for, as PNG bytes, in format order. Raises ImportError without matplotlib."""
    _plt()
    n = _rows_per_panel(doc)
    out: dict[str, bytes] = {}
    for f in doc["formats"]:
        for name, fig in (("headroom", headroom_figure(f, n)), ("fractions", fractions_figure(f, n))):
            if fig is not None:
                out[f"{f['dtype']}_{name}"] = fig
    return out
