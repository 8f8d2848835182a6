"""Console objects, the one-line failure and the one error boundary shared by every command."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from ampdoctor.errors import AmpDoctorError

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


F = TypeVar("F", bound=Callable[..., Any])


def boundary(fn: F) -> F:
    """The error boundary of a command: an ``AmpDoctorError`` raised anywhere in it (options, the
    core, writing outputs) is one line on stderr and exit code 2; Ctrl-C is one line and exit 130.
    A command handles an interrupt itself only to say what it kept (e.g. the step log)."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AmpDoctorError as e:
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted; nothing was written", 130)
        return None

    return command  # type: ignore[return-value]
