"""Options that several commands take, declared once (typer reads the ``Annotated`` metadata)."""

from __future__ import annotations

from typing import Annotated

import typer

SPEC_HELP = "Python file defining build_model() and build_dataloader() (see docs/spec-format.md)"

Device = Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N.")]
Force = Annotated[bool, typer.Option(help="Overwrite existing output files.")]
ModelFn = Annotated[str, typer.Option(help="Name of the model-building function in the spec.")]
DataFn = Annotated[str, typer.Option(help="Name of the dataloader-building function.")]
LossFn = Annotated[str, typer.Option(help="Name of the loss function (optional in the spec).")]
OptimizerFn = Annotated[str, typer.Option(help="Name of the optimizer-building function (optional).")]

__all__ = ["SPEC_HELP", "DataFn", "Device", "Force", "LossFn", "ModelFn", "OptimizerFn"]
