"""`ampdoctor layers`: per-layer numeric range picture for any format. Options → core → table + advice."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import pandas as pd
import typer
from rich.console import Console

from ampdoctor.cli.common import boundary, err, out
from ampdoctor.cli.helpstyle import CODE, OUTPUT, RUN, TABLE, default
from ampdoctor.cli.options import SPEC_HELP, DataFn, Device, Force, LossFn, ModelFn, OptimizerFn
from ampdoctor.errors import UsageError
from ampdoctor.formats import BF16
from ampdoctor.io import check_writable, write_atomic
from ampdoctor.judge.ranges import SORTS
from ampdoctor.records import MODEL

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ampdoctor.input.spec import SpecNames


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


# the command -------------------------------------------------------------------------------------


@boundary
def layers(
    spec: Annotated[Path, typer.Argument(metavar="SPEC", help=SPEC_HELP + ".")],
    dtype: Annotated[str, typer.Option(metavar="LIST", help="Formats: fp16, bf16, fp8_e4m3, fp8_e5m2, mxfp8, nvfp4 (comma-separated).", rich_help_panel=RUN)] = "fp16",
    steps: Annotated[int, typer.Option(metavar="N", help="FP32 reference steps.", rich_help_panel=RUN)] = 3,
    scale: Annotated[str, typer.Option(metavar="X|auto", help="Loss scale the gradients are tested at; auto: the largest that overflows none.", rich_help_panel=RUN)] = "1",
    what: Annotated[str, typer.Option(metavar="LIST", help="Any of activations, grads, weights.", rich_help_panel=RUN)] = "activations,grads,weights",
    underflow_tolerance: Annotated[float, typer.Option(metavar="X", help="Underflow fraction a gradient may lose.", rich_help_panel=RUN)] = 0.01,
    device: Device = "auto",
    seed: Annotated[int, typer.Option(metavar="N", help="RNG seed set before building and stepping.", rich_help_panel=RUN)] = 0,
    max_norm: Annotated[Optional[float], typer.Option(metavar="X", help="Clip the gradient norm to X, as triage does." + default("no clipping"), rich_help_panel=RUN)] = None,
    sort: Annotated[str, typer.Option(metavar="KEY", help="risk, order, module or a column (overflow_frac...).", rich_help_panel=TABLE)] = "risk",
    top: Annotated[int, typer.Option(metavar="N", help="Rows shown per format (0: all; exports hold all).", rich_help_panel=TABLE)] = 40,
    filter: Annotated[Optional[str], typer.Option("--filter", metavar="REGEX", help="Only modules whose name matches (re.search).", rich_help_panel=TABLE)] = None,
    model_fn: ModelFn = "build_model",
    data_fn: DataFn = "build_dataloader",
    loss_fn: LossFn = "loss_fn",
    optimizer_fn: OptimizerFn = "build_optimizer",
    batch_keys: Annotated[Optional[str], typer.Option("--batch-keys", metavar="IN:TARGET", help="A batch's inputs and target, e.g. image:label.", rich_help_panel=CODE)] = None,
    csv: Annotated[Optional[Path], typer.Option("--csv", metavar="PATH", help="Write every step's table as CSV.", rich_help_panel=OUTPUT)] = None,
    parquet: Annotated[Optional[Path], typer.Option("--parquet", metavar="PATH", help="Write it as Parquet (needs pyarrow).", rich_help_panel=OUTPUT)] = None,
    report: Annotated[Optional[Path], typer.Option("--report", metavar="PATH", help="Write a .md, .html or .json report.", rich_help_panel=OUTPUT)] = None,
    force: Force = False,
) -> None:
    """Per layer: what would overflow or underflow in FP16, BF16 or FP8, and the loss scale it takes.

    How much of each activation, gradient and weight would overflow, underflow or go subnormal in each format, and the loss scale its gradients can take.
    """
    from ampdoctor.cli.layers_block import block_tables, split_block
    from ampdoctor.engine.layers import parse_dtypes, parse_what
    from ampdoctor.input.spec import SpecNames

    elements, blocks = split_block(dtype)
    if blocks:  # the block-scaled formats: their own reference steps and table (engine/layers_block.py)
        _check_inputs(sort, top, filter, underflow_tolerance, csv, None, force, None)
        block_tables(out, spec, SpecNames(model_fn, data_fn, loss_fn, optimizer_fn), blocks, steps=steps, device=device, seed=seed,
                     what=parse_what(what), max_norm=max_norm, top=top, csv=csv if elements is None else None)
        if elements is None:
            return
        dtype = elements
    wanted = [f.name for f in parse_dtypes(dtype)]
    what_t = parse_what(what)
    scale_v = _parse_scale(scale)
    _check_inputs(sort, top, filter, underflow_tolerance, csv, parquet, force, report)
    df, dev = _reference_steps(spec, SpecNames(model_fn, data_fn, loss_fn, optimizer_fn), wanted, steps=steps, device=device,
                               seed=seed, scale=scale_v, what=what_t, underflow_tolerance=underflow_tolerance,
                               max_norm=max_norm, pattern=filter, batch_keys=batch_keys)
    _export(df[df["dtype"].isin(wanted)], filter, csv, parquet)
    from ampdoctor.judge.ranges import format_table, sort_summary
    from ampdoctor.render.layers_terminal import print_advice, print_tables

    console: Console = out
    grads = "grads" in what_t
    tables = []
    for name in wanted:
        s, summary = format_table(df, name, scale_v, filter)
        tables.append((name, s, sort_summary(summary, sort)))
    print_tables(console, tables, steps, grads, top)
    for name in wanted:
        print_advice(console, df, name, underflow_tolerance, grads)
    if report is not None:
        from ampdoctor.cli.reports import write_layers_report
        from ampdoctor.input.env import environment
        from ampdoctor.report.layers_doc import build

        config = {"spec": str(spec), "dtype": wanted, "steps": steps, "scale": scale_v, "what": list(what_t), "sort": sort,
                  "top": top, "filter": filter, "underflow_tolerance": underflow_tolerance, "device": device, "seed": seed,
                  "model_fn": model_fn, "data_fn": data_fn, "loss_fn": loss_fn, "optimizer_fn": optimizer_fn,
                  "csv": str(csv) if csv is not None else None, "parquet": str(parquet) if parquet is not None else None}
        write_layers_report(report, build(df, config, environment(dev, ["ampdoctor", *sys.argv[1:]])))
    for path in (csv, parquet, report):
        if path is not None:
            console.print(f"{'report' if path is report else 'table'} written to {path}", style="dim", highlight=False,
                          markup=False)


def _reference_steps(spec: Path, names: SpecNames, wanted: list[str], *, steps: int, device: str, seed: int,
                     scale: float | str, what: tuple[str, ...], underflow_tolerance: float, max_norm: float | None,
                     pattern: str | None, batch_keys: str | None = None) -> tuple[pd.DataFrame, torch.device]:
    """Build the spec's model and batches, run the FP32 reference steps, and return every tensor's rows in each
    format (bf16 as well, not shown: it says whether bf16 removes the problem) and the device they ran on."""
    from ampdoctor.cli.progress import progress_display
    from ampdoctor.engine.forward import optimizer_argument
    from ampdoctor.engine.layers import layer_stats
    from ampdoctor.engine.triage import prepare
    from ampdoctor.input.config import TriageConfig
    from ampdoctor.input.env import resolve_device
    from ampdoctor.input.spec import call_user, importable, load_spec

    cfg = TriageConfig(steps=steps, device=device, seed=seed)
    dev = resolve_device(device)
    sp = load_spec(spec, names)
    keys = batch_keys if batch_keys is not None else sp.options.get("batch_keys")  # (TRIAGE_OPTIONS: the same batches)
    if keys is not None:
        from dataclasses import replace

        from ampdoctor.input.batches import BatchKeys, KeyedLoss

        if not isinstance(keys, str):
            raise UsageError(f"batch_keys must be a string such as \"image:label\" (got {keys!r})")
        sp = replace(sp, loss_fn=KeyedLoss(BatchKeys.parse(keys), sp.loss_fn))
    with importable(spec), progress_display(err, steps) as progress:
        model, batches = prepare(sp, cfg, dev, progress)
        _check_filter(model, pattern)
        optimizer = (call_user(sp.build_optimizer, optimizer_argument(sp.build_optimizer, model),
                               what=f"{names.optimizer}()", path=sp.path) if sp.build_optimizer is not None else None)
        compute = wanted + ([BF16.name] if BF16.name not in wanted else [])
        df = layer_stats(model, batches, compute, steps=steps, scale=scale, what=what, loss_fn=sp.loss_fn,
                         optimizer=optimizer, device=dev, underflow_tolerance=underflow_tolerance, seed=seed, max_norm=max_norm,
                         progress=(lambda step: progress("FP32 steps", step)) if progress is not None else None)
    return df, dev


def _check_filter(model: nn.Module, pattern: str | None) -> None:
    """``--filter`` must match one of the model's module names (else one line listing some)."""
    if pattern is None:
        return
    names = [n or MODEL for n, _ in model.named_modules()]
    if not any(re.search(pattern, n) for n in names):
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise UsageError(f"--filter {pattern!r} matches no module; module names are: {shown}")


def _export(shown: pd.DataFrame, pattern: str | None, csv: Path | None, parquet: Path | None) -> None:
    """Every step's rows of the formats asked for (those of the modules ``--filter`` keeps) to --csv and --parquet."""
    from ampdoctor.engine.layers import filter_modules

    if pattern is not None:
        shown = filter_modules(shown, pattern)
    if csv is not None:
        write_atomic(csv, shown.to_csv(index=False))
    if parquet is not None:
        write_atomic(parquet, shown.to_parquet(index=False))
