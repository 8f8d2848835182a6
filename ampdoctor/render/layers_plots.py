"""PNG figures of a layers report (matplotlib Agg, a base dependency), per format.

``figures(doc)`` returns ``{name: png_bytes}``: ``{dtype}_headroom`` (binades between each
tensor's absmax and the format's max, the tightest tensors first) and ``{dtype}_fractions``
(overflow / underflow / subnormal / NaN-Inf shares of the tensors that have any). Uses the
triage plots' backend setup and PNG writer (no metadata: the same data gives the same bytes).
Nothing here prints or touches files.
"""

from __future__ import annotations

import math
from typing import Any

from ampdoctor.render.common import scale
from ampdoctor.render.plots import _plt, _png
from ampdoctor.report.layers_doc import KIND_LABEL, risk_order

MAX_BARS = 30
"""Tensors per figure: the tightest / worst ones."""

_FRACTIONS = (("overflow_frac", "overflow", "#d62728"), ("underflow_frac", "underflow to 0", "#1f77b4"),
              ("subnormal_frac", "subnormal", "#ff7f0e"), ("nonfinite_frac", "NaN/Inf in FP32", "#222222"))


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


def headroom_figure(fmt: dict[str, Any]) -> bytes | None:
    rows = [r for r in fmt["rows"] if math.isfinite(r["headroom_binades"])]
    if not rows:
        return None
    rows = sorted(rows, key=lambda r: r["headroom_binades"])[:MAX_BARS]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, max(2.2, 0.3 * len(rows) + 1.0)))
    hs = [r["headroom_binades"] for r in rows]
    colors = ["#d62728" if h < 0 else "#ff7f0e" if h < 2 else "#2ca02c" for h in hs]
    ax.barh(range(len(rows)), hs, color=colors)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_label(r) for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=1)
    scaled = f", gradients x {scale(fmt['grad_scale'])}" if fmt["grad_scale"] != 1.0 else ""
    ax.set_xlabel(f"headroom in binades: log2({fmt['dtype']} max / absmax){scaled}; below 0 overflows")
    more = f" (tightest {len(rows)} of {len(fmt['rows'])})" if len(fmt["rows"]) > len(rows) else ""
    ax.set_title(f"{fmt['dtype']}: headroom per tensor{more}")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def fractions_figure(fmt: dict[str, Any]) -> bytes | None:
    rows = [r for r in risk_order(fmt["rows"]) if any(r[k] > 0 for k, _, _ in _FRACTIONS)][:MAX_BARS]
    if not rows:
        return None
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, max(2.4, 0.4 * len(rows) + 1.2)))
    y = np.arange(len(rows))
    h = 0.8 / len(_FRACTIONS)
    for i, (key, label, color) in enumerate(_FRACTIONS):
        ax.barh(y + (i - 1.5) * h, [100 * r[key] for r in rows], height=h, color=color, label=label)
    ax.set_yticks(y)
    ax.set_yticklabels([_label(r) for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlim(left=0)
    ax.set_xlabel("% of elements (worst step)")
    ax.set_title(f"{fmt['dtype']}: overflow, underflow and subnormal shares")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _png(fig)


def figures(doc: dict[str, Any]) -> dict[str, bytes]:
    """Every plot the document has data for, as PNG bytes, in format order. Raises ImportError without matplotlib."""
    _plt()
    out: dict[str, bytes] = {}
    for f in doc["formats"]:
        for name, fig in (("headroom", headroom_figure(f)), ("fractions", fractions_figure(f))):
            if fig is not None:
                out[f"{f['dtype']}_{name}"] = fig
    return out
