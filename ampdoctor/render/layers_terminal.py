"""The terminal picture of ``ampdoctor layers``: one table per format, then each format's advice (rich)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ampdoctor.fmt import pct_short as _pct
from ampdoctor.fmt import pow2 as _pow2
from ampdoctor.fmt import short as _num
from ampdoctor.judge.ranges import tensor_name
from ampdoctor.render.terminal import NAME_MIN_WIDTH
from ampdoctor.report.layers_doc import KIND_LABEL, recommendation

WIDE = 100
"""Below this many columns (an 80-column terminal, a pipe, a CI log) the min≠0 and subn columns are left
out, so every number and the whole tensor name (.weight, .bias) still fit; --csv holds every column."""
NARROW_HIDDEN = ("min≠0", "subn")
_HEAD_STYLE = {"safe": "bold green", "safe_with_scale": "bold yellow", "unsafe": "bold red", "fp32_nonfinite": "bold red"}


def _columns(console_width: int) -> tuple[str, ...]:
    """The columns of the layers table at this console width."""
    cols = ("tensor", "kind", "absmax", "min≠0", "ovf", "unf", "subn", "nan/inf", "head", "window")
    return cols if console_width >= WIDE else tuple(c for c in cols if c not in NARROW_HIDDEN)


def layers_table(rows: pd.DataFrame, title: str, console_width: int = WIDE) -> Table:
    """One format's rows (``judge.ranges.format_table``'s summary) as a table that fits ``console_width``."""
    cols = _columns(console_width)
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=0)
    for head in cols:
        if head == "tensor":
            t.add_column(head, overflow="fold", min_width=NAME_MIN_WIDTH)
        else:
            t.add_column(head, justify="left" if head == "kind" else "right", no_wrap=True)
    for r in rows.itertuples(index=False):
        bad = r.overflow_frac > 0 or r.nonfinite_frac > 0
        window = ""
        if r.kind in ("act_grad", "param_grad"):
            window = f"{_pow2(r.min_scale)}..{_pow2(r.max_scale)}"
            if r.min_scale > r.max_scale:  # no scale fits this gradient
                window = f"[red]{window}[/]"
        cells = {"tensor": escape(tensor_name(r.module, r.kind, r.param)), "kind": KIND_LABEL.get(r.kind, r.kind), "absmax": _num(r.absmax),
                 "min≠0": _num(r.min_nonzero), "ovf": _pct(r.overflow_frac), "unf": _pct(r.underflow_frac),
                 "subn": _pct(r.subnormal_frac), "nan/inf": _pct(r.nonfinite_frac),
                 "head": _num(round(r.headroom_binades, 1)) if math.isfinite(r.headroom_binades) else "inf",
                 "window": window}
        t.add_row(*(cells[c] for c in cols), style="red" if bad else None)
    return t


def print_tables(console: Console, tables: Sequence[tuple[str, float, pd.DataFrame]], steps: int, grads: bool,
                 top: int) -> None:
    """Each format's table: ``tables`` holds (format, gradient scale, summary rows sorted); ``top`` rows of each (0: all)."""
    for name, s, summary in tables:
        rows = summary if top == 0 else summary.head(top)
        title = (f"[bold]{name}[/] — worst of {steps} FP32 step(s)"
                 + ((f"; gradients x {_pow2(s) if math.log2(s).is_integer() else f'{s:g}'}" if s != 1.0
                     else "; gradients unscaled") if grads else ""))
        console.print(layers_table(rows, title, console.width))
        if console.width < WIDE:
            console.print(f"  ({', '.join(NARROW_HIDDEN)} left out below {WIDE} columns; COLUMNS={WIDE} or --csv shows them)",
                          style="dim", highlight=False)
        if len(summary) > len(rows):
            console.print(f"  ... {len(summary) - len(rows)} more rows (--top 0 shows all; --csv exports every step)",
                          style="dim")
    console.print()


def print_advice(console: Console, df: pd.DataFrame, dtype: str, tolerance: float, grads: bool) -> None:
    """The recommendation block of one format (``report.layers_doc.recommendation``, the same words as the reports)."""
    rec = recommendation(df, dtype, tolerance, grads)
    head = Text(rec["headline"], style=_HEAD_STYLE.get(rec["verdict"], "bold"))
    if rec["detail"]:
        head.append(f": {rec['detail']}")
    console.print(head)
    for item in rec["advice"]:
        console.print(Padding(Text(item["text"]), (0, 0, 0, 2 + 2 * int(item["level"])), expand=False))


__all__ = ["NARROW_HIDDEN", "WIDE", "layers_table", "print_advice", "print_tables"]
