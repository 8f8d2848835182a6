"""The FP8 triage report in the terminal: the verdict panel, the rungs, the per-GEMM table, the fixes."""

from __future__ import annotations

import json
import math

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ampdoctor.fmt import num, pct
from ampdoctor.report.fp8 import OPERAND_WORDS, Fp8Report


def _db(x: float) -> str:
    return "inf" if math.isinf(x) else "-" if math.isnan(x) else f"{x:.1f}"


def render(r: Fp8Report, console: Console) -> None:
    where = [f"first module: {r.module}" if r.module else "", f"operand: {OPERAND_WORDS.get(r.operand or '', r.operand)}" if r.operand else "",
             f"step: {r.step}" if r.step is not None else "", f"recipe: {r.recipe}", "emulated" if r.emulated else "FP8 kernels"]
    body = Text(r.title + "\n", style="bold")
    body.append(r.summary + "\n")
    body.append("   ".join(w for w in where if w), style="dim")
    console.print(Panel(body, title=f"ampdoctor verdict: {r.cause}", expand=True))
    rungs = Table(title="Rungs", title_justify="left", box=None, pad_edge=False)
    for col in ("rung", "steps", "first inf/nan", "loss"):
        rungs.add_column(col, justify="left" if col == "rung" else "right")
    for g in r.rungs:
        fn = g["first_nonfinite"]
        rungs.add_row(g["rung"], str(g["steps"]), "-" if fn is None else str(fn), num(g["loss"]))
    console.print(rungs)
    if r.gemms:
        t = Table(title="GEMM operands (FP8 rung, worst over the steps)", title_justify="left", box=None, pad_edge=False)
        for col in ("module", "operand", "fmt", "amax", "scale", "sat", "flushed", "SQNR dB"):
            t.add_column(col, justify="left" if col in ("module", "operand", "fmt") else "right")
        for g in r.gemms:
            t.add_row(g["module"], OPERAND_WORDS.get(g["operand"], g["operand"]), g["dtype"].replace("fp8_", ""),
                      num(g["amax"]), num(g["scale"]), pct(g["saturated"]), pct(g["flushed"]), _db(g["sqnr_db"]))
        console.print(t)
    if r.fixes:
        console.print(Text("What to change", style="bold"))
        for i, f in enumerate(r.fixes, 1):
            console.print(Text(f"  {i}. {f}"))
    if r.emulated:
        console.print(Text("note: FP8 GEMMs emulated (torchao emulate=True): the casts are exact, the products are "
                           "FP32 matmuls of the dequantised operands; see docs/fp8.md", style="dim"))


def to_json(r: Fp8Report) -> str:
    return json.dumps(r.to_dict(), indent=2)
