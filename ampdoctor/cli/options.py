"""Options that several commands take, declared once (typer reads the ``Annotated`` metadata)."""

from __future__ import annotations

from typing import Annotated

import typer

from ampdoctor.cli.helpstyle import CODE, OUTPUT, RUN

SPEC_HELP = "Your spec: build_model() and build_dataloader() (docs/spec-format.md)"
DEVICE_HELP = "auto, cpu, cuda or cuda:N."

Device = Annotated[str, typer.Option(metavar="DEVICE", help=DEVICE_HELP, rich_help_panel=RUN)]
Force = Annotated[bool, typer.Option("--force", help="Overwrite existing output files.", rich_help_panel=OUTPUT)]
ModelFn = Annotated[str, typer.Option(metavar="NAME", help="The spec's model function.", rich_help_panel=CODE)]
DataFn = Annotated[str, typer.Option(metavar="NAME", help="The spec's dataloader function.", rich_help_panel=CODE)]
LossFn = Annotated[str, typer.Option(metavar="NAME", help="The spec's loss function (optional).", rich_help_panel=CODE)]
OptimizerFn = Annotated[str, typer.Option(metavar="NAME", help="The spec's optimizer function (optional).", rich_help_panel=CODE)]

__all__ = ["DEVICE_HELP", "SPEC_HELP", "DataFn", "Device", "Force", "LossFn", "ModelFn", "OptimizerFn"]
