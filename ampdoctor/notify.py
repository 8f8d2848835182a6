"""How ampdoctor speaks from inside a training run: the ``ampdoctor`` logger, heard without any setup.

A run's few important events (the first failing step, a capture written, the skip-rate alert, the
monitor turning itself off) go to the ``ampdoctor`` logger at WARNING. Following the convention of
the training frameworks, the logger has a stderr handler of its own that speaks **only while the
application has configured no logging**: once a handler exists on the root logger (``basicConfig``,
a framework's setup, pytest's capture) or on the ``ampdoctor`` logger, the records go there instead,
and nothing is printed twice. ``logging.getLogger("ampdoctor").setLevel(logging.ERROR)`` silences it;
``Monitor(quiet=True)`` keeps one monitor's records off the default handler.

Warnings (``warnings.warn``) point at the user's line (the first frame outside ampdoctor, torch and
the training frameworks), not at ampdoctor's own file, and name the file as ``shown_path`` does:
relative to the working directory when it lies below it (``python train.py`` makes ``__main__``'s
file absolute; the warning says ``train.py:42``, not the machine's folder).
"""

from __future__ import annotations

import logging
import os
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


def shown_path(path: str | os.PathLike[str]) -> str:
    """A path as a message shows it: relative to the working directory when the file lies below it
    (``sample_models/x.py``, whatever folder the project sits in), else as it is."""
    s = os.fspath(path)
    if not os.path.isabs(s):
        return s
    try:
        rel = os.path.relpath(s)
    except ValueError:  # another drive (Windows), or no working directory
        return s
    return s if rel == ".." or rel.startswith(".." + os.sep) else rel


def warn_user(msg: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the user's line, its file named by ``shown_path``."""
    level = user_stacklevel()
    f = sys._getframe(0)  # stacklevel 1: this frame, the one that calls warnings.warn
    for _ in range(level - 1):
        if f.f_back is None:
            break
        f = f.f_back
    g = f.f_globals
    warnings.warn_explicit(msg, category, shown_path(f.f_code.co_filename), f.f_lineno, str(g.get("__name__", "<string>")),
                           g.setdefault("__warningregistry__", {}), g)


def alert(msg: str, category: type[Warning], *, quiet: bool = False) -> None:
    """An event the user must see once: logged (``say``) and, unless ``quiet``, warned at the user's line, with
    the default handler leaving the logged copy out."""
    say(msg, quiet=quiet, warned=not quiet)
    if not quiet:
        warn_user(msg, category)


__all__ = ["DefaultStderr", "app_configured", "log", "say", "shown_path", "user_stacklevel", "warn_user"]
