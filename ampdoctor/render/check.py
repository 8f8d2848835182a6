"""``ampdoctor check``'s output: the series as a table, each damaged checkpoint's modules, the verdict line (80
columns, piped or not), and its JSON."""

from __future__ import annotations

import json

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ampdoctor.render.scaler_text import indent
from ampdoctor.report.check import MAX_MODULES, CheckReport
from ampdoctor.report.words.check import more_modules

STYLE = {"good": "green", "damaged": "bold red", "unreadable": "yellow"}


def _table(report: CheckReport) -> Table:
    t = Table(title=f"Checkpoints (target {report.target})", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
              pad_edge=False, padding=(0, 1, 0, 0))
    t.add_column("checkpoint", overflow="fold", max_width=28)
    t.add_column("step", justify="right", no_wrap=True)
    t.add_column("state", no_wrap=True)
    t.add_column("what", overflow="fold")
    for c in report.checkpoints:
        t.add_row(Text(c.path), "-" if c.step is None else str(c.step), Text(c.status, style=STYLE[c.status]),
                  Text(c.summary))
    return t


def render(report: CheckReport, out: Console) -> None:
    """The table, then what is wrong in each damaged checkpoint by module, then the verdict."""
    out.print(_table(report))
    for c in report.checkpoints[:]:
        if c.path != report.first_damaged:  # the first damaged one in full; the others' damage is in the table and --json
            continue
        out.print()
        out.print(Text(f"{c.path}: damaged", style="bold"))
        for module, lines in c.modules[:MAX_MODULES]:
            out.print(indent(f"{module}:", 2))
            for line in lines[:6]:
                out.print(indent(f"- {line}", 4, 2))
            if len(lines) > 6:
                out.print(indent(f"- +{len(lines) - 6} more", 4, 2))
        if len(c.modules) > MAX_MODULES:
            out.print(indent(more_modules(len(c.modules) - MAX_MODULES), 2))
    for c in report.checkpoints:
        for note in c.notes if c.status == "unreadable" or c.path == report.first_damaged else []:
            out.print(Text(f"note: {c.path}: {note}", style="dim"))
    out.print()
    out.print(Text(report.verdict, style="bold red" if report.exit_code == 1 else "bold"), soft_wrap=False)


def to_json(report: CheckReport) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


__all__ = ["render", "to_json"]
