"""How ampdoctor speaks from inside a training run: the ``ampdoctor`` logger, heard without any setup.

A run's few important events (the first failing step, a capture written, the skip-rate alert, the
monitor turning itself off) go to the ``ampdoctor`` logger at WARNING. Following the convention of
the training frameworks, the logger has a stderr handler of its own that speaks **only while the
application has configured no logging**: once a handler exists on the root logger (``basicConfig``,
a framework's setup, pytest's capture) or on the ``ampdoctor`` logger, the records go there instead,
and nothing is printed twice. ``logging.getLogger("ampdoctor").setLevel(logging.ERROR)`` silences it;
``Monitor(quiet=True)`` keeps one monitor's records off the default handler.

Warnings (``warnings.warn``) point at the user's line (the first frame outside ampdoctor, torch and
the training frameworks), not at ampdoctor's own file.
"""

from __future__ import annotations

import logging
import sys
import warnings

log = logging.getLogger("ampdoctor")

_INTERNAL = ("ampdoctor", "torch", "transformers", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric",
             "contextlib", "functools", "importlib", "runpy")
"""Modules whose frames are not the user's line (a callback is called from the framework's loop)."""


class DefaultStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """ampdoctor's stderr handler: speaks only while the application configured no logging of its own."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "ampdoctor_quiet", False) or getattr(record, "ampdoctor_warned", False):
            return
        if app_configured():
            return
        self.setStream(sys.stderr)  # the stderr of now (redirected, or captured by a test)
        super().emit(record)


def app_configured() -> bool:
    """Whether a handler other than ours would receive an ``ampdoctor`` record (the application set up logging)."""
    lg: logging.Logger | None = log
    while lg is not None:
        if any(not isinstance(h, (DefaultStderr, logging.NullHandler)) for h in lg.handlers):
            return True
        if not lg.propagate:
            return False
        lg = lg.parent
    return False


if not any(isinstance(h, DefaultStderr) for h in log.handlers):
    log.addHandler(DefaultStderr())


def say(msg: str, *args: object, quiet: bool = False, warned: bool = False) -> None:
    """Log one of a run's events at WARNING (see the module doc). ``warned``: the same words were also
    given to ``warnings.warn``, so the default handler leaves them out (said once)."""
    log.warning(msg, *args, extra={"ampdoctor_quiet": quiet, "ampdoctor_warned": warned})


def user_stacklevel(skip: int = 1) -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the frame ``skip`` levels up from here (1: the
    caller) that names the user's line: the first frame outside ampdoctor, torch and the frameworks (the
    outermost if all are)."""
    f = sys._getframe(skip)  # the frame that calls warnings.warn
    level = 1
    last = level
    while f is not None:
        name = str(f.f_globals.get("__name__", ""))
        if name.split(".")[0] not in _INTERNAL:
            return level
        last = level
        f = f.f_back  # type: ignore[assignment]
        level += 1
    return last


def warn_user(msg: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the user's line."""
    warnings.warn(msg, category, stacklevel=user_stacklevel())


def alert(msg: str, category: type[Warning], *, quiet: bool = False) -> None:
    """An event the user must see once: logged (``say``) and, unless ``quiet``, warned at the user's line, with
    the default handler leaving the logged copy out."""
    say(msg, quiet=quiet, warned=not quiet)
    if not quiet:
        warn_user(msg, category)


__all__ = ["DefaultStderr", "app_configured", "log", "say", "user_stacklevel", "warn_user"]
