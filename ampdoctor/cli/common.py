"""Console objects and the one-line failure shared by every command."""

from __future__ import annotations

import typer
from rich.console import Console

out = Console()
err = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """One line on stderr, then exit (2 for bad input). No traceback."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
