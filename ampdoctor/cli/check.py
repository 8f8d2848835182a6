"""`ampdoctor check PATH...`: which checkpoints of a run are damaged, and which one is the last good one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ampdoctor.cli.common import boundary, err, out
from ampdoctor.formats import get_format
from ampdoctor.io import write_atomic

TARGETS = {"fp16": "fp16", "bf16": "bf16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


@boundary
def check(
    paths: Annotated[list[Path], typer.Argument(
        metavar="PATH...", help="Checkpoints: torch.save files, .safetensors, Lightning .ckpt, Trainer checkpoint-N/ "
                                "folders, torch.distributed.checkpoint folders, or a run folder holding checkpoint-N/.")],
    target: Annotated[str, typer.Option(metavar="FORMAT", help="The format the weights must fit: fp16, bf16, fp8.")] = "fp16",
    json_path: Annotated[Optional[Path], typer.Option("--json", metavar="PATH", help="Write the result as JSON ('-': stdout).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --json file.")] = False,
) -> None:
    """Which checkpoints hold NaN/Inf, broken Adam moments or a collapsed GradScaler; the last good one.

    Exit 0: all healthy; 1: damage found; 2: bad input (one line says why)."""
    from ampdoctor.errors import UsageError
    from ampdoctor.input.checkpoint_series import read_series
    from ampdoctor.io import check_writable
    from ampdoctor.render.check import render, to_json
    from ampdoctor.report.check import build

    if target.lower() not in TARGETS:
        raise UsageError(f"--target is fp16, bf16 or fp8 (got {target!r})")
    fmt = get_format(TARGETS[target.lower()])
    to_stdout = json_path is not None and str(json_path) == "-"
    if json_path is not None and not to_stdout:
        check_writable(json_path, force)
    report = build(read_series(paths), fmt)
    if len(report.checkpoints) == 1 and report.checkpoints[0].error:
        raise UsageError(report.checkpoints[0].error)  # one checkpoint that cannot be read: its one line, exit 2
    human = err if to_stdout else out
    render(report, human)
    if json_path is not None:
        if to_stdout:
            typer.echo(to_json(report), nl=False)
        else:
            write_atomic(json_path, to_json(report))
            human.print(f"report written to {json_path}", style="dim", highlight=False, markup=False)
    raise typer.Exit(report.exit_code)


__all__ = ["check"]
