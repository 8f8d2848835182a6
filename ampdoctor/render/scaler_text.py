"""The terminal text of ``ampdoctor scaler``: a step log's digest (``judge.log_digest.LogDigest``) and its worded scale
diagnosis (``report.scaler.ScaleDiagnosis``), printed to the command's console."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ampdoctor.fmt import pow2
from ampdoctor.judge.log_digest import LogDigest
from ampdoctor.report.scaler import ScaleDiagnosis

MAX_LEDGER_ROWS = 20
"""Runs of consecutive skips the ledger table shows in full."""


def indent(text: str, indent: int, hang: int = 0) -> Table:
    """A paragraph indented by ``indent``; wrapped lines indented ``hang`` more (under the text after '- ')."""
    g = Table.grid()
    g.add_column(width=indent + hang, no_wrap=True)
    g.add_column()
    g.add_row(Text(" " * indent + text[:hang]), Text(text[hang:]))
    return g


def print_digest(out: Console, path: Path, notes: list[str], dig: LogDigest, diag: ScaleDiagnosis | None, window: int,
                 alert_rate: float) -> None:
    """The report of ``ampdoctor scaler`` on one log: the scale history, the skip ledger, the rolling skip rate and
    the recommendations, in words already written (``diag``: ``report.scaler.worded``; None without GradScaler)."""
    ledger = dig.ledger
    out.print(f"[bold]{escape(str(path))}[/]: {dig.n} steps ({dig.first_step}..{dig.last_step}), {ledger.count} skipped",
              highlight=False, soft_wrap=True)
    for note in notes:
        out.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    out.print()
    if diag is None:
        out.print("[bold]Scale history[/]: none (the scaler_scale column is empty: a run without GradScaler)")
    else:
        out.print(f"[bold]Scale history[/]: [bold cyan]{diag.pattern}[/]", highlight=False)
        out.print(indent(diag.explanation, 2))
        gi = f"{diag.growth_interval}" if diag.growth_interval else "not seen (no growth)"
        bo = f"{diag.backoff_factor:g}" if diag.backoff_factor else "not seen (no back-off)"
        out.print(indent(
            f"scale {pow2(diag.min_scale)}..{pow2(diag.max_scale)}, final {pow2(diag.final_scale)}; "
            f"{len(diag.growths)} growth(s), {len(diag.backoffs)} back-off(s); growth_interval {gi}, backoff_factor {bo}",
            2))
    out.print()
    out.print(f"[bold]Skip ledger[/]: {ledger.count} of {ledger.total} steps ({ledger.rate:.2%}), "
              f"{ledger.n_runs} run(s), longest {ledger.longest}", highlight=False)
    if dig.first_applied is not None:
        step, reason = dig.first_applied
        out.print(indent(f"{dig.applied} step(s) applied a non-finite update (nothing skipped them: no GradScaler, "
                          f"or the loop did not check), the first at step {step} ({reason}): "
                          "the weights took it", 2), style="red")
    if ledger.count:
        for reason, n in ledger.reasons_by_count().items():
            out.print(f"  {n:6d}  {reason}", highlight=False, markup=False)
        t = Table(show_edge=False, pad_edge=False, box=None)
        for col in ("steps", "skips", "reason(s)", "scale"):
            t.add_column(col)
        for run in ledger.runs[:MAX_LEDGER_ROWS]:
            span = f"{run.start}" if run.start == run.end else f"{run.start}-{run.end}"
            reasons = ", ".join(dict.fromkeys(r or "(none)" for r in run.reasons))
            t.add_row(span, str(run.length), escape(reasons), "" if run.scale is None else pow2(run.scale))
        out.print(t)
        if ledger.n_runs > MAX_LEDGER_ROWS:
            out.print(f"  ... {ledger.n_runs - MAX_LEDGER_ROWS} more run(s)", style="dim")
    out.print()
    # the first steps' rate is over a handful of steps (100% after one calibration skip): judge from a full-ish window
    final, from_step, peak, at, over = dig.rates.summary()
    style = "red" if final > alert_rate else "green"
    out.print(
        f"[bold]Rolling skip rate[/] (window {window}): final [{style}]{final:.2%}[/]; from step {from_step}: "
        f"peak {peak:.2%} at step {at}, above {alert_rate:.0%} on {over} step(s)", highlight=False,
    )
    if diag is not None and diag.recommendations:
        out.print()
        out.print("[bold]Recommendations[/]")
        for r in diag.recommendations:
            out.print(indent(f"- {r}", 2, hang=2))
        if diag.settings:
            args = ", ".join(f"{k}={v:g}" for k, v in diag.settings.items())  # numbers, as Python reads them
            out.print(f"  torch.amp.GradScaler(device, {args})", highlight=False)
