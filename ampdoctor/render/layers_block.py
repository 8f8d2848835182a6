"""The block-scaled formats' layers table in the terminal."""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.table import Table

from ampdoctor.fmt import pct
from ampdoctor.scaled import BlockFormat

KINDS = {"act": "output", "act_grad": "grad", "param": "weight", "param_grad": "wgrad"}


def print_block_table(console: Console, fmt: BlockFormat, df: pd.DataFrame, steps: int, top: int) -> None:
    title = (f"{fmt.name}: blocks of {fmt.block} whose range exceeds the format, elements flushed / saturated "
             f"(worst of {steps} FP32 step(s))")
    t = Table(title=title, title_justify="left", box=None, pad_edge=False)
    for col in ("module", "kind", "param", "blocks", "exceeding", "flushed", "saturated"):
        t.add_column(col, justify="left" if col in ("module", "kind", "param") else "right")
    rows = df if top == 0 else df.head(top)
    for r in rows.itertuples(index=False):
        t.add_row(str(r.module), KINDS.get(str(r.kind), str(r.kind)), str(r.param), str(r.blocks), pct(float(r.exceeding_frac)),
                  pct(float(r.flushed_frac)), pct(float(r.saturated_frac)))
    console.print(t)
