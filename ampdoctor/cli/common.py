"""Console objects, the one-line failure and the one error boundary shared by every command."""

from __future__ import annotations

import functools
import os
import signal
import sys
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
    if code == 130:
        exit_on_second_interrupt()
    line = Text("error:", style="bold red")
    line.append(f" {message}")
    err.print(line, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


_interrupted = False


def _again(signum: int, frame: object) -> None:
    try:
        sys.stderr.write("error: interrupted again; exiting now\n")
        sys.stderr.flush()
    finally:
        os._exit(130)


def _first(signum: int, frame: object) -> None:
    """The first Ctrl-C of a command: a KeyboardInterrupt (the command says what it kept); a second one,
    wherever it lands (cleanup, DataLoader workers, a handler still printing), exits 130 at once."""
    global _interrupted
    _interrupted = True
    _set_sigint(_again)
    raise KeyboardInterrupt


def _set_sigint(handler: Any) -> Any:
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: leave it alone
        return None


def exit_on_second_interrupt() -> None:
    """After the first Ctrl-C, a second one exits at once with 130, as the first would, instead of by the
    signal (-2) or with a traceback."""
    global _interrupted
    _interrupted = True
    _set_sigint(_again)


F = TypeVar("F", bound=Callable[..., Any])


def boundary(fn: F) -> F:
    """The error boundary of a command: an ``AmpDoctorError`` raised anywhere in it (options, the
    core, writing outputs) is one line on stderr and exit code 2, and so is a ``sys.exit`` in the user's code;
    Ctrl-C is one line and exit 130 (a second Ctrl-C exits 130 at once).
    A command handles an interrupt itself only to say what it kept (e.g. the step log)."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        global _interrupted
        _interrupted = False
        previous = _set_sigint(_first) if signal.getsignal(signal.SIGINT) is signal.default_int_handler else None
        try:
            return fn(*args, **kwargs)
        except AmpDoctorError as e:
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted; nothing was written", 130)
        except SystemExit as e:  # user code the command ran called sys.exit (ampdoctor's own exits are typer.Exit)
            code = "" if e.code is None else repr(e.code)
            fail(f"your code called sys.exit({code}) while ampdoctor ran it; ampdoctor calls your functions itself, "
                 "so return (or raise an exception) instead of exiting")
        finally:
            if previous is not None and not _interrupted:  # interrupted: a second Ctrl-C still exits 130 (atexit, workers)
                _set_sigint(previous)
        return None

    return command  # type: ignore[return-value]
