"""`ampdoctor layers` (placeholder until the layers issue lands)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ampdoctor.cli_common import fail


def layers(spec: Annotated[Path, typer.Argument(help="Spec file.")]) -> None:
    """Per-layer numeric range picture for a format (not built yet)."""
    fail("ampdoctor layers is not built yet")
