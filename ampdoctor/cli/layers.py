"""`ampdoctor layers`: per-layer numeric range picture for any format. Options → core → table + advice."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Annotated, Optional

import pandas as pd
import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ampdoctor.cli.common import boundary, err, out
from ampdoctor.errors import UsageError
from ampdoctor.fmt import pct_short as _pct
from ampdoctor.fmt import pow2 as _pow2
from ampdoctor.fmt import short as _num
from ampdoctor.formats import BF16
from ampdoctor.io import check_writable, write_atomic
from ampdoctor.judge.ranges import SORTS, tensor_name
from ampdoctor.report.layers_doc import KIND_LABEL

NAME_WIDTH = 30
NAME_MIN_WIDTH = 18
"""The tensor column folds long names onto more lines, never narrower than this (never one letter per line)."""
WIDE = 100
"""Below this many columns (an 80-column terminal, a pipe, a CI log) the min≠0 and subn columns are left
out, so every number and the whole tensor name (.weight, .bias) still fit; --csv holds every column."""
NARROW_HIDDEN = ("min≠0", "subn")
_HEAD_STYLE = {"safe": "bold green", "safe_with_scale": "bold yellow", "unsafe": "bold red", "fp32_nonfinite": "bold red"}


def _parse_scale(text: str) -> float | str:
    """'auto', a number, or a power of two written 2**16 / 2^16."""
    t = text.strip().lower()
    if t == "auto":
        return "auto"
    m = re.fullmatch(r"2\s*(?:\*\*|\^)\s*(-?\d+)", t)
    try:
        v = 2.0 ** int(m.group(1)) if m else float(t)
    except (ValueError, OverflowError):
        v = math.nan
    if not (v > 0 and math.isfinite(v)):
        raise UsageError(f"--scale {text!r}: give a positive number (e.g. 65536 or 2**16) or auto")
    return v


def _check_inputs(sort: str, top: int, pattern: Optional[str], tolerance: float, csv: Optional[Path],
                  parquet: Optional[Path], force: bool, report: Optional[Path] = None) -> None:
    """Everything that can be refused before the model is built."""
    if sort not in SORTS:
        raise UsageError(f"--sort {sort!r}: choose one of {', '.join(SORTS)}")
    if top < 0:
        raise UsageError("--top must be 0 (all rows) or a positive number of rows")
    if not 0 <= tolerance < 1:
        raise UsageError(f"--underflow-tolerance must be in [0, 1), e.g. 0.01 (got {tolerance})")
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as e:
            raise UsageError(f"--filter {pattern!r} is not a valid regular expression ({e})") from None
    if parquet is not None and importlib.util.find_spec("pyarrow") is None:
        raise UsageError("--parquet needs pyarrow, which is not installed: pip install pyarrow (or use --csv)")
    if csv is not None and parquet is not None and csv.resolve() == parquet.resolve():
        raise UsageError("--csv and --parquet name the same file; give two paths")
    for path in (csv, parquet):
        if path is not None:
            check_writable(path, force)
    if report is not None:
        from ampdoctor.cli.reports import check_report_path

        if any(p is not None and p.resolve() == report.resolve() for p in (csv, parquet)):
            raise UsageError("--report names the same file as --csv or --parquet; give another path")
        check_report_path(report, force)  # the extension, an existing file, and the PNG folder beside a .md


# rendering ---------------------------------------------------------------------------------------


def _short(name: str, width: int = NAME_WIDTH) -> str:
    """Keep the tail of a long dotted name (the most specific part) and mark the cut."""
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _dividers(console_width: int) -> tuple[str, ...]:
    """The columns of the layers table at this console width."""
    cols = ("tensor", "kind", "absmax", "min≠0", "ovf", "unf", "subn", "nan/inf", "head", "window")
    return cols if console_width >= WIDE else tuple(c for c in cols if c not in NARROW_HIDDEN)


def _table(rows: pd.DataFrame, title: str, console_width: int = WIDE) -> Table:
    cols = _dividers(console_width)
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=0)
    for head in cols:
        if head == "tensor":
            t.add_column(head, overflow="fold", min_width=NAME_MIN_WIDTH)
        else:
            t.add_column(head, justify="left" if head == "kind" else "right", no_wrap=True)
    for r in rows.itertuples(index=False):
        name = tensor_name(r.module, r.kind, r.param)
        bad = r.overflow_frac > 0 or r.nonfinite_frac > 0
        window = ""
        if r.kind in ("act_grad", "param_grad"):
            window = f"{_pow2(r.min_scale)}..{_pow2(r.max_scale)}"
            if r.min_scale > r.max_scale:  # no scale fits this gradient
                window = f"[red]{window}[/]"
        cells = {"tensor": escape(name), "kind": KIND_LABEL.get(r.kind, r.kind), "absmax": _num(r.absmax),
                 "min≠0": _num(r.min_nonzero), "ovf": _pct(r.overflow_frac), "unf": _pct(r.underflow_frac),
                 "subn": _pct(r.subnormal_frac), "nan/inf": _pct(r.nonfinite_frac),
                 "head": _num(round(r.headroom_binades, 1)) if math.isfinite(r.headroom_binades) else "inf",
                 "window": window}
        t.add_row(*(cells[c] for c in cols), style="red" if bad else None)
    return t


def _print_advice(console: Console, df: pd.DataFrame, dtype: str, tolerance: float, grads: bool) -> None:
    """The recommendation block of one format (``layers_report.recommendation``, the same words as the reports)."""
    from ampdoctor.report.layers_doc import recommendation

    rec = recommendation(df, dtype, tolerance, grads)
    head = Text(rec["headline"], style=_HEAD_STYLE.get(rec["verdict"], "bold"))
    if rec["detail"]:
        head.append(f": {rec['detail']}")
    console.print(head)
    for item in rec["advice"]:
        console.print(Padding(Text(item["text"]), (0, 0, 0, 2 + 2 * int(item["level"])), expand=False))


# the command -------------------------------------------------------------------------------------


@boundary
def layers(
    spec: Annotated[Path, typer.Argument(help="Python file defining build_model() and build_dataloader() (see docs/spec-format.md).")],
    dtype: Annotated[str, typer.Option(help="Target format(s), comma-separated: fp16, bf16, fp8_e4m3, fp8_e5m2.")] = "fp16",
    steps: Annotated[int, typer.Option(help="FP32 reference steps (an optimizer step between them).")] = 3,
    scale: Annotated[str, typer.Option(help="Multiply gradients by this before the cast test (a GradScaler scale), "
                                             "or auto: the largest power of two that overflows no gradient.")] = "1",
    what: Annotated[str, typer.Option(help="Comma-separated: activations, grads, weights.")] = "activations,grads,weights",
    sort: Annotated[str, typer.Option(help="risk (worst first) | order (forward order) | module | a column, e.g. "
                                            "overflow_frac, headroom_binades.")] = "risk",
    top: Annotated[int, typer.Option(help="Rows to show per format (0: all). Exports always hold every row.")] = 40,
    filter: Annotated[Optional[str], typer.Option("--filter", help="Only modules whose name matches this regex (re.search).")] = None,
    csv: Annotated[Optional[Path], typer.Option("--csv", help="Write the full table (every step) as CSV.")] = None,
    parquet: Annotated[Optional[Path], typer.Option("--parquet", help="Write the full table as Parquet (needs pyarrow).")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write a report to attach to a ticket: .md (PNG plots "
                                                   "beside it), .json (schema: ampdoctor/schema/layers.schema.json) or .html.")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite existing output files.")] = False,
    underflow_tolerance: Annotated[float, typer.Option(help="Underflow fraction a gradient may lose at the smallest "
                                                             "scale of its window.")] = 0.01,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N.")] = "auto",
    seed: Annotated[int, typer.Option(help="RNG seed set before the model is built and before the steps.")] = 0,
    model_fn: Annotated[str, typer.Option(help="Name of the model-building function in the spec.")] = "build_model",
    data_fn: Annotated[str, typer.Option(help="Name of the dataloader-building function.")] = "build_dataloader",
    loss_fn: Annotated[str, typer.Option(help="Name of the loss function (optional in the spec).")] = "loss_fn",
    optimizer_fn: Annotated[str, typer.Option(help="Name of the optimizer-building function (optional).")] = "build_optimizer",
    max_norm: Annotated[Optional[float], typer.Option(help="Clip the global L2 gradient norm to this in the reference steps, as triage --max-norm does. [default: no clipping]")] = None,
) -> None:
    """Per layer: how much of each activation, gradient and weight would overflow, underflow or go
    subnormal in FP16/BF16/FP8, and the loss scale its gradients can take."""
    from ampdoctor.engine.layers import filter_modules, layer_stats, parse_dtypes, parse_what
    from ampdoctor.engine.step import optimizer_argument

    fmts = parse_dtypes(dtype)
    what_t = parse_what(what)
    scale_v = _parse_scale(scale)
    _check_inputs(sort, top, filter, underflow_tolerance, csv, parquet, force, report)
    from ampdoctor.cli.progress import progress_display
    from ampdoctor.engine.triage import prepare
    from ampdoctor.input.config import TriageConfig
    from ampdoctor.input.env import resolve_device
    from ampdoctor.input.spec import SpecNames, call_user, importable, load_spec

    cfg = TriageConfig(steps=steps, device=device, seed=seed)
    dev = resolve_device(device)
    sp = load_spec(spec, SpecNames(model_fn, data_fn, loss_fn, optimizer_fn))
    with importable(spec), progress_display(err, steps) as progress:
        model, batches = prepare(sp, cfg, dev, progress)
        if filter is not None:
            names = [n or "<model>" for n, _ in model.named_modules()]
            if not any(re.search(filter, n) for n in names):
                shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise UsageError(f"--filter {filter!r} matches no module; module names are: {shown}")
        optimizer = (call_user(sp.build_optimizer, optimizer_argument(sp.build_optimizer, model), what=f"{optimizer_fn}()",
                               path=sp.path) if sp.build_optimizer is not None else None)
        wanted = [f.name for f in fmts]
        # bf16 is computed as well (not shown) to say whether it removes the problem
        compute = wanted + ([BF16.name] if BF16.name not in wanted else [])
        df = layer_stats(model, batches, compute, steps=steps, scale=scale_v, what=what_t, loss_fn=sp.loss_fn,
                         optimizer=optimizer, device=dev, underflow_tolerance=underflow_tolerance, seed=seed, max_norm=max_norm,
                         progress=(lambda step: progress("FP32 steps", step)) if progress is not None else None)
    shown = df[df["dtype"].isin(wanted)]
    if filter is not None:
        shown = filter_modules(shown, filter)
    if csv is not None:
        write_atomic(csv, shown.to_csv(index=False))
    if parquet is not None:
        write_atomic(parquet, shown.to_parquet(index=False))
    console: Console = out
    grads = "grads" in what_t
    from ampdoctor.judge.ranges import format_table, sort_summary

    for name in wanted:
        s, summary = format_table(df, name, scale_v, filter)
        summary = sort_summary(summary, sort)
        rows = summary if top == 0 else summary.head(top)
        title = (f"[bold]{name}[/] — worst of {steps} FP32 step(s)"
                 + ((f"; gradients x {_pow2(s) if math.log2(s).is_integer() else f'{s:g}'}" if s != 1.0
                     else "; gradients unscaled") if grads else ""))
        console.print(_table(rows, title, console.width))
        if console.width < WIDE:
            console.print(f"  ({', '.join(NARROW_HIDDEN)} left out below {WIDE} columns; COLUMNS={WIDE} or --csv shows them)",
                          style="dim", highlight=False)
        if len(summary) > len(rows):
            console.print(f"  ... {len(summary) - len(rows)} more rows (--top 0 shows all; --csv exports every step)",
                          style="dim")
    console.print()
    for name in wanted:
        _print_advice(console, df, name, underflow_tolerance, grads)
    if report is not None:
        from ampdoctor.cli.reports import write_layers_report
        from ampdoctor.input.env import environment
        from ampdoctor.report.layers_doc import build

        config = {"spec": str(spec), "dtype": wanted, "steps": steps, "scale": scale_v, "what": list(what_t), "sort": sort,
                  "top": top, "filter": filter, "underflow_tolerance": underflow_tolerance, "device": device, "seed": seed,
                  "model_fn": model_fn, "data_fn": data_fn, "loss_fn": loss_fn, "optimizer_fn": optimizer_fn,
                  "csv": str(csv) if csv is not None else None, "parquet": str(parquet) if parquet is not None else None}
        doc = build(df, config, environment(dev, ["ampdoctor", *sys.argv[1:]]))
        write_layers_report(report, doc)
    for path in (csv, parquet, report):
        if path is not None:
            console.print(f"{'report' if path is report else 'table'} written to {path}", style="dim", highlight=False,
                          markup=False)
