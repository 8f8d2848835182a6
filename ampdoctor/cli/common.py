"""Console objects and the one-line failure shared by every command."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.text import Text

out = Console()
err = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """One line on stderr, then exit (2 for bad input). No traceback.

    ``message`` is plain text: square brackets in a path or module name are printed as they are
    (never read as rich markup), and the line is never wrapped.
    """
    line = Text("error:", style="bold red")
    line.append(f" {message}")
    err.print(line, highlight=False, soft_wrap=True)
    raise typer.Exit(code)
