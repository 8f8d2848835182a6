"""PNG figures of a Report, drawn with matplotlib's Agg backend (matplotlib is a base dependency).

``figures(report)`` returns ``{name: png_bytes}`` for every plot the report has data for:
``loss`` (loss per stage against step, FP32 as the reference line), ``scale`` (GradScaler scale,
log2, skipped steps marked), ``heatmap`` (layers × steps: overflow, non-finite and flushed shares)
and ``headroom`` (binades of FP16 headroom per layer). Nothing here prints or touches files.
"""

from __future__ import annotations

import io
import math
from typing import Any

from ampdoctor.render.common import history, scaled_stage, step0
from ampdoctor.report.model import Report

INSTALL_HINT = "plots need matplotlib, which ampdoctor installs but this environment lacks: pip install matplotlib"

TITLES = {
    "loss": "Loss per stage against step",
    "scale": "GradScaler scale against step",
    "heatmap": "Layers × steps: overflow, non-finite and flushed shares",
    "headroom": "FP16 headroom per layer",
    "history": "Before the failure: the lookback ring's last steps",
}

_COLORS = {"fp32": "#222222", "fp16": "#d62728", "amp": "#1f77b4", "bf16": "#2ca02c"}


def available() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any, tight: bool = True) -> bytes:
    """PNG bytes; ``tight=False`` keeps the figure's own size (panels drawn to one size stay one size)."""
    buf = io.BytesIO()
    # no Software/date metadata: the same report gives the same bytes
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight" if tight else None, metadata={"Software": None})
    _plt().close(fig)
    return buf.getvalue()


def loss_figure(report: Report) -> bytes | None:
    stages = [s for s in report.stages if s.losses]
    if not stages:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for n, s in enumerate(sorted(stages, key=lambda s: s.name != "fp32")):
        o = step0(report)
        xs = [o + i for i in range(len(s.losses))]
        ys = [x if math.isfinite(x) else math.nan for x in s.losses]
        ref = s.name == "fp32"
        ax.plot(xs, ys, label=f"{s.name}{' (reference)' if ref else ''}", color=_COLORS.get(s.name),
                linewidth=2.4 if ref else 1.4, linestyle="--" if ref else "-", zorder=3 if ref else 2,
                marker="o" if len(xs) == 1 else None)  # a one-step replay: a point, not an invisible line
        bad = [o + i for i, x in enumerate(s.losses) if not math.isfinite(x)]
        if bad:  # on the top edge of the axes (no height means anything for an inf), one row per stage
            ax.scatter(bad, [0.97 - 0.05 * n] * len(bad), marker="x", color=_COLORS.get(s.name, "red"), zorder=4,
                       transform=ax.get_xaxis_transform(), clip_on=False, label=f"{s.name}: non-finite loss (top edge)")
    _mark_step(ax, report)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(_integer_ticks())  # steps are whole: a short replay gets no 4.8, 5.2 ticks
    ax.set_ylabel("loss")
    ax.set_title(TITLES["loss"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return _png(fig)


def scale_figure(report: Report) -> bytes | None:
    stage = scaled_stage(report)
    if stage is None:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.2))
    o = step0(report)
    pts = [(o + i, math.log2(x)) for i, x in enumerate(stage.scales) if x is not None and x > 0]
    ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color=_COLORS["amp"], label=f"{stage.name}: log2(scale)")
    skips = set(stage.skipped_steps)  # the run's own step numbers
    skipped = [(o + i, math.log2(x)) for i, x in enumerate(stage.scales) if o + i in skips and x is not None and x > 0]
    if skipped:
        ax.scatter([p[0] for p in skipped], [p[1] for p in skipped], marker="v", color="#d62728", zorder=3,
                   label=f"skipped step ({len(skipped)})")
    _mark_step(ax, report)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.set_ylabel("log2(scale)")
    ax.set_title(TITLES["scale"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return _png(fig)


CULPRIT = "#d62728"
"""The colour every plot marks the verdict's module, op and step in."""


def _mark_step(ax: Any, report: Report) -> None:
    """The verdict's step as a red dotted line, in the legend: the step every other part of the report names."""
    v = report.verdict
    if v.first_step is not None and v.cause not in ("healthy", "data"):
        ax.axvline(v.first_step, color=CULPRIT, linestyle=":", linewidth=1.6, zorder=1,
                   label=f"verdict: first bad step {v.first_step}")


def is_culprit(report: Report, module: str) -> bool:
    """The verdict's module, or an op inside it ('blocks.1.attn > matmul')."""
    first = report.verdict.first_module
    return bool(first) and (module == first or module.startswith(f"{first} > "))


def _integer_ticks() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True, min_n_ticks=1)


def heat_colors() -> tuple[Any, Any]:
    """The heatmap's colour map and log norm (1e-4 to 1): magma reversed without its palest end, so that the
    smallest share drawn still stands out from the white of a 0."""
    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm

    cmap = ListedColormap(_plt().get_cmap("magma_r")(np.linspace(0.18, 1.0, 256))).with_extremes(bad=(0, 0, 0, 0))
    return cmap, LogNorm(vmin=1e-4, vmax=1.0, clip=True)


def heatmap_figure(report: Report) -> bytes | None:
    """Layers x steps, three panels. The op the verdict names (a row of ``report.layers`` of kind 'op',
    measured at one step by the FP32 op scan) is the first row; the verdict's module is marked in red.
    The colour scale is logarithmic (1e-4 to 1), so that any non-zero share shows; cells a row has no
    measurement for are grey."""
    cells = report.layer_steps
    if not cells:
        return None
    import numpy as np

    plt = _plt()
    ops = [r for r in report.layers if r.kind == "op"]
    keys = [(r.module, "op") for r in ops] + list(dict.fromkeys((c.module, c.kind) for c in cells))
    steps = sorted({c.step for c in cells})
    col = {s: i for i, s in enumerate(steps)}
    row = {k: i for i, k in enumerate(keys)}
    panels = [("overflow_frac", "overflow (FP32 cast to FP16)"), ("nonfinite_frac", "non-finite (target stage)"),
              ("flushed_frac", "flushed to 0 (target stage)")]
    height = max(2.6, 0.28 * len(keys) + 1.4)
    fig, axes = plt.subplots(1, 3, figsize=(12, height), sharey=True, layout="constrained")
    cmap, norm = heat_colors()
    v = report.verdict
    im = None
    for ax, (field, title) in zip(axes, panels, strict=True):
        grid = np.zeros((len(keys), len(steps)))
        for c in cells:
            grid[row[(c.module, c.kind)], col[c.step]] = getattr(c, field)
        for r in ops:
            grid[row[(r.module, "op")]] = np.nan
            s = r.first_nonfinite_step if r.first_nonfinite_step is not None else v.first_step
            if s in col:
                grid[row[(r.module, "op")], col[s]] = {"overflow_frac": r.overflow_frac, "nonfinite_frac": r.nonfinite_frac,
                                                      "flushed_frac": r.underflow_frac}[field]
        unmeasured = np.isnan(grid)
        ax.imshow(np.where(unmeasured, 0.82, 1.0), aspect="auto", cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        shown = np.ma.masked_where(unmeasured | (grid <= 0), np.maximum(grid, 1e-4))
        im = ax.imshow(shown, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        tick = max(1, len(steps) // 8)
        ax.set_xticks(range(0, len(steps), tick))
        ax.set_xticklabels([str(steps[i]) for i in range(0, len(steps), tick)], fontsize=7)
        culprit = [i for i, (m, _k) in enumerate(keys) if is_culprit(report, m)]
        if culprit and v.first_step in col:
            from matplotlib.patches import Rectangle

            i = culprit[0]
            ax.add_patch(Rectangle((col[v.first_step] - 0.5, i - 0.5), 1, 1, fill=False, edgecolor=CULPRIT, linewidth=2.0,
                                   clip_on=False))
    axes[0].set_yticks(range(len(keys)))
    axes[0].set_yticklabels([f"{m} [{k}]" for m, k in keys], fontsize=7)
    for lab, (m, _k) in zip(axes[0].get_yticklabels(), keys, strict=True):
        if is_culprit(report, m):
            lab.set_color(CULPRIT)
            lab.set_fontweight("bold")
    fig.colorbar(im, ax=list(axes), fraction=0.025, pad=0.01, label="share of elements (log; blank: 0, grey: not measured)")
    fig.suptitle(TITLES["heatmap"] + "; red box and label: the verdict's module and step", fontsize=10)
    return _png(fig)


def headroom_rows(report: Report) -> list[tuple[str, float]]:
    """(label, headroom) per layer: the heatmap's layers (largest FP32 |x| over steps), then report.layers."""
    best: dict[tuple[str, str], float] = {}
    for c in report.layer_steps:
        best[(c.module, c.kind)] = max(best.get((c.module, c.kind), 0.0), c.absmax_fp32)
    out = {k: math.log2(65504.0 / a) if a > 0 and math.isfinite(a) else math.inf for k, a in best.items()}
    for r in report.layers:
        out.setdefault((r.module, r.kind), r.headroom_binades)
    return [(f"{m} [{k}]", h) for (m, k), h in out.items() if not math.isnan(h)]


def headroom_figure(report: Report) -> bytes | None:
    rows = [(n, h) for n, h in headroom_rows(report) if not math.isinf(h)]
    if not rows:
        return None
    plt = _plt()
    rows.sort(key=lambda r: r[1])
    fig, ax = plt.subplots(figsize=(6.0, max(2.2, 0.3 * len(rows) + 1.0)))
    colors = ["#d62728" if h < 0 else "#ff7f0e" if h < 2 else "#2ca02c" for _, h in rows]
    mine = [is_culprit(report, n.rsplit(" [", 1)[0]) for n, _ in rows]
    ax.barh(range(len(rows)), [h for _, h in rows], color=colors, edgecolor=["black" if c else "none" for c in mine],
            linewidth=1.2)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([n for n, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=1)
    lo = min(h for _, h in rows)
    mark_below_zero(ax, [h for _, h in rows])
    for lab, c in zip(ax.get_yticklabels(), mine, strict=True):
        if c:
            lab.set_color(CULPRIT)
            lab.set_fontweight("bold")
    _headroom_legend(ax, first=any(mine), marked=lo < 0)
    ax.set_xlabel("headroom in binades: log2(65504 / FP32 absmax); below 0 overflows FP16")
    ax.set_title(TITLES["headroom"])
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def mark_below_zero(ax: Any, hs: list[float], fontsize: float = 8) -> bool:
    """Bars below 0 (the overflows, the cause) must not be slivers on a long axis: room on the left in proportion to
    the axis, a marker at each bar's end and its value right of 0, where a negative row has no bar (clear of the
    row names on the left). Whether there was one."""
    neg = [(i, h) for i, h in enumerate(hs) if h < 0]
    if not neg:
        return False
    ax.set_xlim(left=min(min(hs) * 1.3, -0.08 * max(max(hs), 1.0)))
    ax.scatter([h for _, h in neg], [i for i, _ in neg], marker="<", s=60, color="#d62728", edgecolor="black",
               linewidth=0.8, zorder=3)
    for i, h in neg:
        ax.annotate(f"{h:.1f} binades: overflows", (0, i), xytext=(4, 0), textcoords="offset points", ha="left",
                    va="center", fontsize=fontsize, color="#d62728", fontweight="bold")
    return True


def below_zero_marker() -> Any:
    """The legend's entry for ``mark_below_zero``'s marker."""
    from matplotlib.lines import Line2D

    return Line2D([], [], marker="<", linestyle="none", markerfacecolor="#d62728", markeredgecolor="black",
                  label="end of a bar below 0")


def _headroom_legend(ax: Any, first: bool, marked: bool = False) -> None:
    """What each bar colour means (and the verdict's own rows, the marker of a bar too short to see), for a headroom
    chart."""
    from matplotlib.patches import Patch

    items: list[Any] = [Patch(color="#d62728", label="below 0: overflows"), Patch(color="#ff7f0e", label="under 2 binades: thin"),
                        Patch(color="#2ca02c", label="2 binades or more")]
    if marked:
        items.append(below_zero_marker())
    if first:
        items.append(Patch(facecolor="white", edgecolor="black", label="red label, outlined: the verdict's module"))
    ax.legend(handles=items, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _series(xs: list[Any]) -> list[float]:
    out = []
    for x in xs:
        try:
            out.append(float(x))
        except (TypeError, ValueError):
            out.append(math.nan)
    return out


def history_figure(report: Report) -> bytes | None:
    """The steps before a captured failure, from the capture's lookback ring: the culprit layer's headroom
    (the step it crossed 0 marked), the loss and gradient norm, and the loss scale with the skipped steps."""
    told = history(report)
    if told is None or not told.evidence.get("series"):
        return None
    ev = told.evidence
    s = ev["series"]
    steps = [int(x) for x in s["step"]]
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.2), sharex=True)
    _history_headroom(axes[0], ev)
    ax = axes[1]
    loss = _series(s["loss"])
    ax.plot(steps, [x if math.isfinite(x) else math.nan for x in loss], color="#222222", label="loss")
    bad = [st for st, x in zip(steps, loss, strict=True) if not math.isfinite(x)]
    fin = [x for x in loss if math.isfinite(x)]
    if bad and fin:
        ax.scatter(bad, [max(fin)] * len(bad), marker="x", color="#d62728", label="non-finite loss", zorder=3)
    ax.set_ylabel("loss")
    g = _series(s["grad_norm"])
    handles, labels = ax.get_legend_handles_labels()
    if any(math.isfinite(x) and x > 0 for x in g):
        a2 = ax.twinx()
        a2.plot(steps, [x if math.isfinite(x) and x > 0 else math.nan for x in g], color="#ff7f0e", alpha=0.8,
                label="gradient norm (right axis)")
        a2.set_yscale("log")
        a2.set_ylabel("gradient norm (log)")
        more = a2.get_legend_handles_labels()  # every line in the one legend: the twin axis's too
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(handles), frameon=False,
              borderaxespad=0.1)  # above the panel: off the lines, and clear of the right axis's label
    ax.grid(alpha=0.3)
    ax = axes[2]
    sc = _series(s["scale"])
    pts = [(st, math.log2(x)) for st, x in zip(steps, sc, strict=True) if math.isfinite(x) and x > 0]
    if pts:
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color=_COLORS["amp"], label="log2(scale)")
        skipped = {st for st, k in zip(steps, _series(s["skipped"]), strict=True) if k == 1.0}
        sk = [p for p in pts if p[0] in skipped]
        if sk:
            ax.scatter([p[0] for p in sk], [p[1] for p in sk], marker="v", color="#d62728", zorder=3,
                       label=f"skipped step ({len(sk)})")
        ax.legend(fontsize=8)
    ax.set_ylabel("log2(scale)")
    ax.set_xlabel("step (the run's own)")
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.grid(alpha=0.3)
    return _png(fig)


def _history_headroom(ax: Any, ev: dict[str, Any]) -> None:
    """The history's top panel: the culprit's headroom, where it ran out (the label above the plot, off the line it
    marks); for a ``data`` verdict, the step the batch's NaN/Inf went through and how far every layer stayed from
    FP16's max."""
    hd = ev.get("headroom")
    if hd:
        hs = [h if math.isfinite(h) else math.nan for h in _series(hd["binades"])]
        ax.plot(hd["step"], hs, color=_COLORS["amp"], label=f"{ev.get('layer')}: headroom (binades)")
        ax.axhline(0, color="#d62728", linewidth=1, label="0: FP16's max")
        ax.legend(fontsize=8, loc="lower left")
    mark, words = ev.get("crossed_step"), "headroom ran out at step {}"
    if ev.get("data"):
        mark, words = ev.get("nonfinite_step"), "non-finite at step {}, with the batch"
        low = ev.get("least_headroom")
        if low and not hd:
            ax.text(0.02, 0.5, f"no layer came near FP16's max: least headroom {low['binades']:.1f} binades ({low['layer']})",
                    transform=ax.transAxes, fontsize=8, va="center")
            ax.set_yticks([])
    if isinstance(mark, int):
        ax.axvline(mark, color="#d62728", linestyle=":", linewidth=1)
        ax.annotate(words.format(mark), (mark, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                    textcoords="offset points", ha="right", va="bottom", fontsize=8, color="#d62728")
    ax.set_ylabel("FP16 headroom")
    ax.grid(alpha=0.3)
    ax.set_title(TITLES["history"], fontsize=10, pad=14)


def figures(report: Report) -> dict[str, bytes]:
    """Every plot the report has data for, as PNG bytes. Raises ImportError without matplotlib.

    A replay with the capture's lookback ring draws the run's own history (``history``) in place of the
    replay's few points of loss and scale."""
    _plt()
    told = history_figure(report)
    if told is not None:
        made = {"history": told, "heatmap": heatmap_figure(report), "headroom": headroom_figure(report)}
    else:
        made = {"loss": loss_figure(report), "scale": scale_figure(report), "heatmap": heatmap_figure(report),
                "headroom": headroom_figure(report)}
    return {k: v for k, v in made.items() if v is not None}
