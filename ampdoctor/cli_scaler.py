"""`ampdoctor scaler` (placeholder until the scaler issue lands)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ampdoctor.cli_common import fail


def scaler(csv: Annotated[Path, typer.Argument(help="Step log CSV.")]) -> None:
    """GradScaler forensics from a step log (not built yet)."""
    fail("ampdoctor scaler is not built yet")
