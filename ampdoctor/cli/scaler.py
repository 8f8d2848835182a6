"""`ampdoctor scaler steps.csv`: GradScaler forensics from a step log (ours, or any CSV with its columns)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import typer
from rich.markup import escape
from rich.table import Table

from ampdoctor.cli.common import boundary, fail, out
from ampdoctor.cli.helpstyle import OUTPUT, default
from ampdoctor.errors import AmpDoctorError, UsageError
from ampdoctor.fmt import pow2
from ampdoctor.io import check_writable, write_atomic
from ampdoctor.judge.log_digest import LogDigest
from ampdoctor.parallel.exchange import LOCAL_KINDS, parse_column
from ampdoctor.render.scaler_plot import scaler_png
from ampdoctor.render.scaler_text import MAX_LEDGER_ROWS, indent, print_digest
from ampdoctor.report.scaler import worded
from ampdoctor.watch.steplog import COLUMNS
from ampdoctor.watch.steplog_read import NotStreamable, StepLog, StepLogStream, read_step_log


@boundary
def scaler(
    csvs: Annotated[list[Path], typer.Argument(
        metavar="CSV",
        help="Step logs (triage --log, Monitor(log=...)); several: one per rank, compared side by side.")],
    window: Annotated[int, typer.Option(metavar="N", help="Steps in the rolling skip rate.")] = 1000,
    alert_rate: Annotated[float, typer.Option(metavar="X", help="Skip rate that counts as an alert.")] = 0.05,
    growth_interval: Annotated[Optional[int], typer.Option(metavar="N", help="The run's growth_interval." + default("from the log"))] = None,
    backoff_factor: Annotated[Optional[float], typer.Option(metavar="X", help="The run's backoff_factor." + default("from the log"))] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", metavar="PNG", help="Draw scale and loss against step to this PNG.", rich_help_panel=OUTPUT)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing plot file.", rich_help_panel=OUTPUT)] = False,
) -> None:
    """GradScaler forensics from a step log: scale history, skip ledger, skip rate, what to change.

    The log's columns: %s (extra columns are fine).
    """
    _check_options(window, alert_rate, growth_interval, backoff_factor)
    if plot is not None:
        check_writable(plot, force)
        _need_matplotlib()
    if len(csvs) > 1:
        _print_ranks([read_step_log(c) for c in csvs])
        out.print()
    csv = csvs[0]
    dig, notes = _digest(csv, window, alert_rate, plot is not None)
    if dig.bad is not None:
        step, value = dig.bad
        fail(f"{csv}: column scaler_scale, step {step}: {value:g} is not a loss scale "
             "(GradScaler's scale is a positive number); fix that row or leave the column empty")
        return
    diag = worded(dig.scale.diagnose(growth_interval=growth_interval, backoff_factor=backoff_factor)) if dig.scale else None
    print_digest(out, csv, notes, dig, diag, window, alert_rate)
    if plot is not None:
        write_atomic(plot, scaler_png(dig, diag.pattern if diag else None))
        out.print(f"plot written to {plot}", style="dim", markup=False, highlight=False)


BLOCK_BYTES = 512 << 10
"""Bytes of the log read at a time: memory stays about the same for a log of any length."""


scaler.__doc__ = (scaler.__doc__ or "") % ", ".join(COLUMNS)  # the columns as the reader knows them


def _digest(csv: Path, window: int, alert_rate: float, plot: bool) -> tuple[LogDigest, list[str]]:
    """The log's digest, read a block at a time; a log the fast path cannot stream (a bad row to name, repeated or
    unsorted steps) is read whole by the validating reader, which names the row or de-duplicates and sorts."""
    stream = StepLogStream(csv, BLOCK_BYTES)
    try:
        first = _first_scale(stream)
        dig = LogDigest(window, alert_rate, first, keep_runs=MAX_LEDGER_ROWS, plot=plot)
        for frame in stream:
            if not dig.feed(frame):
                break
        return dig, stream.notes
    except NotStreamable:
        log = read_step_log(csv)
        scales = log.scales
        dig = LogDigest(window, alert_rate, None if scales is None else scales[0], keep_runs=MAX_LEDGER_ROWS, plot=plot)
        dig.feed(log.frame)
        return dig, log.notes


def _first_scale(stream: StepLogStream) -> float | None:
    """The first non-empty scaler_scale of the log (None: the column is empty throughout). Reads the log until it."""
    for frame in stream:
        col = frame["scaler_scale"].to_numpy(dtype="float64")
        ok = np.flatnonzero(~np.isnan(col))
        if ok.size:
            return float(col[ok[0]])
    return None


MAX_WINDOW = 10**9


def _check_options(window: int, alert_rate: float, growth_interval: int | None, backoff_factor: float | None) -> None:
    """Settings that cannot be (a rate of 2, a growth interval of 0, a back-off of 1.5 or NaN): one line each."""
    import math

    if not 1 <= window <= MAX_WINDOW:
        raise UsageError(f"--window must be a number of steps from 1 to {MAX_WINDOW:,} (got {str(window)[:24]}), e.g. --window 1000")
    if not (math.isfinite(alert_rate) and 0 <= alert_rate <= 1):
        raise UsageError(f"--alert-rate is a fraction of steps, from 0 to 1 (got {alert_rate:g}); e.g. --alert-rate 0.05 for 5%")
    if growth_interval is not None and not 1 <= growth_interval <= 2**31 - 1:
        raise UsageError(f"--growth-interval is GradScaler's number of clean steps before it grows the scale: at least 1 "
                         f"(got {str(growth_interval)[:24]}); its default is 2000")
    if backoff_factor is not None and not (math.isfinite(backoff_factor) and 0 < backoff_factor < 1):
        raise UsageError(f"--backoff-factor is what GradScaler multiplies the scale by after a skip: a number between 0 "
                         f"and 1 (got {backoff_factor:g}); its default is 0.5")


def _rank_of(log: StepLog, i: int) -> int:
    """The log's rank: its ``rank`` column, else ``.rankN`` in its file name, else its place on the command line."""
    col = log.frame["rank"] if "rank" in log.frame.columns else None
    if col is not None and len(col) and str(col.iloc[0]).strip().isdigit():
        return int(str(col.iloc[0]).strip())
    m = re.search(r"\.rank(\d+)(\.|$)", log.path.name)
    return int(m.group(1)) if m else i


def _print_ranks(logs: list[StepLog]) -> None:
    """Several ranks' logs: one line per rank, who went non-finite first, whether the ranks agree."""
    ranked = sorted(((_rank_of(lg, i), lg) for i, lg in enumerate(logs)), key=lambda t: t[0])
    t = Table(show_edge=False, pad_edge=False, box=None)
    for col in ("rank", "steps", "skipped", "first skip", "final scale", "first non-finite (this rank)"):
        t.add_column(col)
    first_fault: tuple[int, list[tuple[int, str, str | None]]] | None = None
    for rank, lg in ranked:
        steps, skipped = lg.steps, lg.skipped
        first_skip = next((s for s, k in zip(steps, skipped, strict=True) if k), None)
        scales = lg.scales
        mine = ""
        if "ranks" in lg.frame.columns:
            for s, text in zip(steps, lg.frame["ranks"].astype(str).tolist(), strict=True):
                seen = parse_column(text if text != "nan" else "")
                if seen:
                    if first_fault is None or s < first_fault[0]:
                        first_fault = (s, seen)
                    own = [x for x in seen if x[0] == rank]
                    if own and not mine:
                        mine = f"{s} {own[0][1]}" + (f" {own[0][2]}" if own[0][2] else "")
        t.add_row(str(rank), f"{steps[0]}..{steps[-1]}", str(sum(skipped)), "-" if first_skip is None else str(first_skip),
                  "-" if scales is None else pow2(scales[-1]), escape(mine or "-"))
    out.print(f"[bold]{len(logs)} rank logs[/]", highlight=False)
    out.print(t)
    if first_fault is not None:
        step, seen = first_fault
        local = [x for x in seen if x[1] in LOCAL_KINDS]
        who = (local or seen)[0]
        where = f" in {who[2]}" if who[2] else ""
        rest = ("the other ranks were clean: rank " + str(who[0]) + "'s own batch or forward, not a range every rank shares"
                if len(local) <= 1 else
                f"{len(local)} ranks saw it themselves ({', '.join(str(x[0]) for x in local[:8])}): a range problem they share")
        out.print(indent(f"First non-finite: step {step}, rank {who[0]} ({who[1]}{where}); {rest}", 0))
    elif not any("ranks" in lg.frame.columns for lg in logs):
        out.print(indent("these logs have no ranks column (Monitor under torch.distributed writes it): "
                          "first non-finite rank unknown", 0), style="dim")
    # DDP keeps one loss scale: the ranks' scales and skips agree step by step, or their scalers drifted apart
    base_rank, base = ranked[0]
    none: list[float | None] = [None] * len(base.steps)
    ref = dict(zip(base.steps, zip(base.skipped, base.scales or none, strict=True), strict=True))
    for rank, lg in ranked[1:]:
        nones: list[float | None] = [None] * len(lg.steps)
        for s, k, sc in zip(lg.steps, lg.skipped, lg.scales or nones, strict=True):
            r = ref.get(s)
            if r is not None and (r[0] != k or r[1] != sc):
                out.print(indent(
                    f"ranks {base_rank} and {rank} disagree from step {s}: rank {base_rank} "
                    f"{'skipped' if r[0] else 'applied'} at scale {pow2(r[1]) if r[1] else '-'}, rank {rank} "
                    f"{'skipped' if k else 'applied'} at scale {pow2(sc) if sc else '-'}. Their GradScalers are out of "
                    "step: the found-inf flag is not shared across ranks (FSDP needs ShardedGradScaler; parameters "
                    "outside DDP are not all-reduced), so ranks apply different updates", 0), style="red")
                break
        else:
            continue
        break
    else:
        out.print("every rank used the same scale and skipped the same steps (as DDP requires)", style="dim", markup=False,
                  highlight=False)
    out.print(f"details below: rank {base_rank} ({escape(str(base.path))})", style="dim", highlight=False)


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise AmpDoctorError("--plot needs matplotlib, which ampdoctor installs but this environment lacks: pip install matplotlib") from None


__all__: list[Any] = ["scaler"]
