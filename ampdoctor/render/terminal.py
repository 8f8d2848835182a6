"""The rich terminal report."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ampdoctor.render.common import CAUSE_TITLES, history, listed, num, pct, scale, steps
from ampdoctor.report.model import Report

KIND = {"activation": "output", "grad": "out grad", "param_grad": "grad", "op": "op"}
NAME_MIN_WIDTH = 18
"""The module column never gets narrower than this (at 80 columns names fold onto a second line
instead of one letter per line); the numeric columns never wrap or get cut."""


def _table(title: str) -> Table:
    """A compact table that fits 80 columns: no side borders, one space (the box's divider) between columns."""
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=0)


def _indented(text: str, indent: int) -> Padding:
    """A paragraph whose wrapped lines keep the indent of its first."""
    return Padding(Text(text), (0, 0, 0, indent))


def _numbered(items: list[str]) -> Table:
    """'  1. text' with the wrapped lines under the text, not under the number."""
    g = Table.grid(padding=(0, 1, 0, 0))
    g.add_column(justify="right", no_wrap=True)
    g.add_column()
    for i, item in enumerate(items, 1):
        g.add_row(f"  {i}.", Text(item))
    return g


def _code(report: Report, console: Console) -> None:
    """What ``ampdoctor lint`` found in the spec and --script, right under the verdict it may explain."""
    if not report.lint:
        return
    console.print(Text("In the code (ampdoctor lint)", style="bold"))
    for c in report.lint:
        head = Text()
        head.append(f"{c.path}:{c.line}:{c.col}", style="bold")
        head.append(f" {c.code}", style="bold red" if c.explains else "bold yellow")
        head.append(f" {c.message}")
        if c.explains:
            head.append(f" (can cause {report.verdict.cause})", style="red")
        console.print(Padding(head, (0, 0, 0, 2)))
        console.print(Padding(Text(f"fix: {c.fix}", style="dim"), (0, 0, 0, 4)))


def render(report: Report, console: Console) -> None:
    v = report.verdict
    ok = v.cause == "healthy"
    color = "green" if ok else "red" if v.cause not in ("inconclusive", "not_reproduced", "replay_mismatch") else "yellow"
    head = Text(CAUSE_TITLES.get(v.cause, v.cause), style=f"bold {color}")
    lines = [head, Text(v.summary)]
    facts = []
    if v.first_module:
        facts.append(f"first module: [bold]{escape(v.first_module)}[/]")
    if v.first_step is not None:
        facts.append(f"{'batch' if v.cause == 'data' else 'step'}: [bold]{v.first_step}[/]")
    if v.stage:
        facts.append(f"stage: {escape(v.stage)}")
    facts.append(f"device: {escape(v.device)}")
    lines.append(Text.from_markup("   ".join(facts)))
    console.print(Panel(Group(*lines), title=f"ampdoctor verdict: {v.cause}", border_style=color))
    _code(report, console)

    t = _table("Stages")
    for col in ("stage", "steps", "first inf/nan", "skips", "scale", "loss", "fp32 loss", "note"):
        t.add_column(col, justify="right" if col not in ("stage", "note") else "left", no_wrap=col != "note",
                     min_width=NAME_MIN_WIDTH if col == "note" else None)
    for s in report.stages:
        note = ""
        if s.error:
            note = f"[red]{escape(str(s.error['type']))} at step {s.error['step']}[/]"
        elif s.stopped:
            note = escape(s.stopped)
        elif s.name == "fp16":
            note = "FP32 master" if s.master_weights else "FP16 weights"
        t.add_row(escape(s.name), str(s.steps_run), num(s.first_nonfinite_step), str(len(s.skipped_steps)) if s.skipped_steps else "0",
                  scale(s.final_scale), num(s.final_loss), num(s.fp32_loss) if s.name != "fp32" else "", note)
    console.print(t)

    if report.layers:
        lt = _table("Layers: FP32 values cast to FP16; flushed / non-finite in the target stage")
        for col in ("module / parameter", "kind", "fp32 absmax", "headroom", "overflow", "flushed", "nan/inf", "step"):
            name_col = col == "module / parameter"
            lt.add_column(col, justify="left" if col in ("module / parameter", "kind") else "right",
                          no_wrap=not name_col, overflow="fold", min_width=NAME_MIN_WIDTH if name_col else None)
        for r in report.layers:
            style = "red" if r.nonfinite_frac > 0 or r.overflow_frac > 0 else "yellow" if r.underflow_frac > 0 else ""
            lt.add_row(escape(r.module), KIND.get(r.kind, r.kind), num(r.absmax_fp32), f"{r.headroom_binades:.1f}" if r.headroom_binades != float("inf") else "inf",
                       pct(r.overflow_frac), pct(r.underflow_frac), pct(r.nonfinite_frac), num(r.first_nonfinite_step), style=style)
        console.print(lt)

    if report.scaler:
        sc = report.scaler
        console.print(Text.from_markup(
            f"[bold]GradScaler[/]: {escape(sc.pattern)} — init {scale(sc.init_scale)}, final {scale(sc.final_scale)}, "
            f"min {scale(sc.min_scale)}; skipped {len(sc.skips)} step(s): {steps([e.step for e in sc.skips])}"))
        console.print(_indented(sc.explanation, 2))

    told = history(report)
    if told is not None:  # the lookback ring's story of the steps before the failure
        console.print(Text("Before the failure", style="bold"))
        console.print(_indented(told.title, 2))
        for x in told.evidence.get("lines", []):
            console.print(_indented(x, 4))
    other = [f for f in listed(report) if f.severity == "warning"]
    if other:
        console.print(Text("Warnings", style="bold"))
        for f in other:
            console.print(Text.from_markup(f"  [yellow]•[/] {escape(f.title)}" + (f" — {escape(f.fix)}" if f.fix else "")))
    if report.fixes:
        console.print(Text("What to change", style="bold"))
        console.print(_numbered(report.fixes))
    for n in report.notes:
        console.print(Text(f"note: {n}", style="dim"))
