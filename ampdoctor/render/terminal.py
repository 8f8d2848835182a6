"""The rich terminal report."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ampdoctor.render.common import CAUSE_TITLES, num, pct, scale, steps
from ampdoctor.report.model import Report

KIND = {"activation": "output", "grad": "out grad", "param_grad": "grad", "op": "op"}


def render(report: Report, console: Console) -> None:
    v = report.verdict
    ok = v.cause == "healthy"
    color = "green" if ok else "red" if v.cause not in ("inconclusive", "not_reproduced") else "yellow"
    head = Text(CAUSE_TITLES.get(v.cause, v.cause), style=f"bold {color}")
    lines = [head, Text(v.summary)]
    facts = []
    if v.first_module:
        facts.append(f"first module: [bold]{v.first_module}[/]")
    if v.first_step is not None:
        facts.append(f"{'batch' if v.cause == 'data' else 'step'}: [bold]{v.first_step}[/]")
    if v.stage:
        facts.append(f"stage: {v.stage}")
    facts.append(f"device: {v.device}")
    lines.append(Text.from_markup("   ".join(facts)))
    console.print(Panel(Group(*lines), title=f"ampdoctor verdict: {v.cause}", border_style=color))

    t = Table(title="Stages", title_justify="left")
    for col in ("stage", "steps", "first inf/nan", "skips", "scale", "loss", "fp32 loss", "note"):
        t.add_column(col, justify="right" if col not in ("stage", "note") else "left", no_wrap=col != "note")
    for s in report.stages:
        note = ""
        if s.error:
            note = f"[red]{s.error['type']} at step {s.error['step']}[/]"
        elif s.stopped:
            note = s.stopped
        elif s.name == "fp16":
            note = "FP32 master" if s.master_weights else "FP16 weights"
        t.add_row(s.name, str(s.steps_run), num(s.first_nonfinite_step), str(len(s.skipped_steps)) if s.skipped_steps else "0",
                  scale(s.final_scale), num(s.final_loss), num(s.fp32_loss) if s.name != "fp32" else "", note)
    console.print(t)

    if report.layers:
        lt = Table(title="Layers: FP32 values cast to FP16; flushed / non-finite in the target stage", title_justify="left")
        for col in ("module / parameter", "kind", "fp32 absmax", "headroom", "overflow", "flushed", "non-finite", "step"):
            lt.add_column(col, justify="left" if col in ("module / parameter", "kind") else "right",
                          no_wrap=col != "module / parameter", overflow="fold")
        for r in report.layers:
            style = "red" if r.nonfinite_frac > 0 or r.overflow_frac > 0 else "yellow" if r.underflow_frac > 0 else ""
            lt.add_row(r.module, KIND.get(r.kind, r.kind), num(r.absmax_fp32), f"{r.headroom_binades:.1f}" if r.headroom_binades != float("inf") else "inf",
                       pct(r.overflow_frac), pct(r.underflow_frac), pct(r.nonfinite_frac), num(r.first_nonfinite_step), style=style)
        console.print(lt)

    if report.scaler:
        sc = report.scaler
        console.print(Text.from_markup(
            f"[bold]GradScaler[/]: {sc.pattern} — init {scale(sc.init_scale)}, final {scale(sc.final_scale)}, "
            f"min {scale(sc.min_scale)}; skipped {len(sc.skips)} step(s): {steps([e.step for e in sc.skips])}"))
        console.print(f"  {sc.explanation}")

    other = [f for f in report.findings if f.severity == "warning"]
    if other:
        console.print(Text("Warnings", style="bold"))
        for f in other:
            console.print(Text.from_markup(f"  [yellow]•[/] {f.title}" + (f" — {f.fix}" if f.fix else "")))
    if report.fixes:
        console.print(Text("What to change", style="bold"))
        for i, fx in enumerate(report.fixes, 1):
            console.print(f"  {i}. {fx}")
    for n in report.notes:
        console.print(Text(f"note: {n}", style="dim"))
