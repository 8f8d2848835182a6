"""The per-step CSV log: one line a step, flushed as it is written; and a validating reader.

Columns, in this order (extra columns may follow)::

    step, lr, grad_l2_pre_clip, grad_l2_post_clip, loss, skipped, skip_reason, scaler_scale

``skipped`` is 0/1; ``skip_reason`` is empty, ``nonfinite_loss`` or ``nonfinite_grad:<module>``;
``scaler_scale`` is the scale the step *used* (empty without a GradScaler); floats are written
with ``repr`` (``nan``, ``inf`` and ``-inf`` included) so they read back exactly.

Every line is written with one ``write`` and flushed to the operating system at once, so a
process that is killed (Ctrl-C, SIGKILL, out of memory) loses no finished step. ``fsync=True``
also survives a power cut, at the cost of a disk flush a step.

An existing log is never truncated without being asked (``mode``):

- ``"append"`` (default): a missing or empty file gets a header; an existing one must have the
  same header, and is appended to only by a run that resumes (its first step is not a fresh run's first,
  0, or ``fresh_step``; e.g. after ``Monitor.load_state_dict``); a fresh run onto a log that has rows is
  refused.
  An incomplete last line (a process killed mid-write) is cut off first: it is not a finished step.
- ``"new"``: refuse if the file exists and is not empty.
- ``"overwrite"``: start the file afresh (the user said so, e.g. ``--force``).

The reader keeps the last row of a step that appears twice (a resumed run redid it) and says so.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

from ampdoctor.errors import AmpDoctorError, OutputError
from ampdoctor.io import write_failure
from ampdoctor.notify import say, warn_user

COLUMNS: tuple[str, ...] = (
    "step",
    "lr",
    "grad_l2_pre_clip",
    "grad_l2_post_clip",
    "loss",
    "skipped",
    "skip_reason",
    "scaler_scale",
)
"""The leading columns of every step log, in order."""

NUMERIC = ("lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss", "scaler_scale")
MAY_BE_EMPTY = ("lr", "scaler_scale")
Mode = Literal["append", "new", "overwrite"]


class StepLogError(AmpDoctorError):
    """A step log cannot be written or read; the message names the file, column or row."""


def format_value(v: Any) -> str:
    """One CSV cell: None → empty, bool → 0/1, float → repr (nan, inf, -inf), tensors → their value."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"
    if hasattr(v, "item") and callable(v.item):  # numpy/torch scalars
        v = v.item()
        if isinstance(v, bool):
            return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return repr(v)
    return str(v)


def _as_mapping(record: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    if isinstance(record, Mapping):
        return record
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    raise TypeError(f"a step record must be a mapping or a dataclass instance, not {type(record).__name__}")


def format_row(record: Mapping[str, Any] | Any, columns: Sequence[str] = COLUMNS) -> str:
    """The CSV line (with its newline) for a record: a mapping or a dataclass such as ``stages.StepRecord``.

    Keys not in ``columns`` are ignored; missing ones are written empty. ``step`` is required.
    """
    rec = _as_mapping(record)
    if "step" not in rec:
        raise StepLogError("a step record needs a 'step' value")
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([format_value(rec.get(c)) for c in columns])
    return buf.getvalue()


def header_line(columns: Sequence[str] = COLUMNS) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(list(columns))
    return buf.getvalue()


class StepLogWarning(UserWarning):
    """The step log cannot be written (a full disk, a quota, an I/O error): rows are being lost; training goes on."""


OnError = Literal["warn", "raise"]
RETRY_MAX_GAP = 256
"""After a failed write, the next attempts are made 1, 2, 4, ... rows later, at most this many apart: a full
disk costs one failing system call every so often, and the log resumes when space comes back."""


def _open_raw(path: Path, mode: str) -> IO[bytes]:
    """The log file, unbuffered: each row is one system call (the tests patch this to fill the disk)."""
    return open(path, mode, buffering=0)  # noqa: SIM115


class StepLogWriter:
    """Writes a step log line by line, each line in one system call. Opens the file at the first ``write``.

    ``StepLogWriter(path).write({"step": 0, "lr": 1e-3, ..., "scaler_scale": 65536.0})``, or pass
    a dataclass instance with those fields. Use as a context manager, or call ``close()``.

    A write that fails (no space left, a quota, an I/O error) never leaves half a line: the file is cut
    back to its last whole row. ``on_error="warn"`` (the Monitor: training must go on) warns once
    (``StepLogWarning``, and the ``ampdoctor`` logger) that rows are being lost from that step, keeps
    trying now and then (1, 2, 4, ... rows apart), and says at ``close()`` which steps are missing;
    ``write`` and ``close`` never raise for it. ``on_error="raise"`` (``ampdoctor triage --log``): the
    partial log this writer created is removed and ``OutputError`` names the path and the bytes.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        extra_columns: Sequence[str] = (),
        mode: Mode = "append",
        fsync: bool = False,
        on_error: OnError = "warn",
        fresh_step: int = 0,
    ) -> None:
        if mode not in ("append", "new", "overwrite"):
            raise StepLogError(f"mode must be 'append', 'new' or 'overwrite', not {mode!r}")
        if on_error not in ("warn", "raise"):
            raise StepLogError(f"on_error must be 'warn' or 'raise', not {on_error!r}")
        dup = [c for c in extra_columns if c in COLUMNS]
        if dup:
            raise StepLogError(f"extra column(s) {', '.join(dup)} repeat the standard columns")
        self.path = Path(path)
        self.columns: tuple[str, ...] = COLUMNS + tuple(extra_columns)
        self.mode: Mode = mode
        self.fsync = fsync
        self.on_error: OnError = on_error
        self.fresh_step = fresh_step
        """The number of a fresh run's first step (0; 1 where the framework numbers a step by the count after it,
        as the Trainer's global_step does): a run starting there onto a log with rows is refused."""
        self._f: IO[bytes] | None = None
        self._good = 0
        """Bytes of the file that are whole rows (a failed write is cut back to here)."""
        self._pending = b""
        """The header of a new file, written with the first row."""
        self._created = False
        self.rows_written = 0
        self.rows_lost = 0
        """Rows that could not be written."""
        self.lost_steps: list[tuple[int, int]] = []
        """(first, last) step of each run of rows that could not be written."""
        self._skip = 0
        self._gap = 1
        self._warned = False
        self._summarised = False

    # opening ---------------------------------------------------------------------------------
    def check(self, first_step: int | None) -> None:
        """Raise now the ``StepLogError`` the first ``write`` would raise (nothing is written): the Monitor
        calls it at construction, so a wrong log path fails before training starts, not after a step.
        ``first_step=None``: the run's first step is not known yet (a ``load_state_dict`` may follow), so
        an existing log with rows is judged at the first write."""
        self._existing(first_step)

    def _existing(self, first_step: int | None) -> bytes | None:
        """Every check of the path before writing; the existing log's bytes when it is appended to, else None."""
        p = self.path
        if p.is_dir():
            raise StepLogError(f"{p} is a directory; give a file path for the step log")
        if not p.parent.exists():
            raise StepLogError(f"folder {p.parent} does not exist; create it first")
        size = p.stat().st_size if p.exists() else 0
        if self.mode == "overwrite" or size == 0:
            return None
        if self.mode == "new":
            raise StepLogError(f"{p} exists; choose another path, or overwrite it on purpose (mode='overwrite', --force)")
        # append: same header, a resumed run
        with open(p, "rb") as fb:
            data = fb.read()
        first_line = data.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r")
        have = next(csv.reader([first_line]), [])
        if tuple(have) != self.columns:
            raise StepLogError(
                f"{p} has columns {','.join(have)!s}, not {','.join(self.columns)}; "
                "write to another path, or overwrite it on purpose (mode='overwrite')"
            )
        rows = data.count(b"\n") - 1
        if first_step == self.fresh_step and rows > 0:
            raise StepLogError(
                f"{p} already holds {rows} step(s) and this run starts at step {first_step}, a fresh run's first; write to another path, "
                "overwrite it on purpose (mode='overwrite'), or load the monitor's state_dict to resume"
            )
        return data

    def _open(self, first_step: int) -> IO[bytes]:
        p = self.path
        data = self._existing(first_step)
        if data is None:
            self._created = not p.exists()
            f = _open_raw(p, "wb")
            self._pending = header_line(self.columns).encode("utf-8")
            self._good = 0
            return f
        if not data.endswith(b"\n"):
            with open(p, "r+b") as fb:  # a half-written line is not a finished step
                fb.truncate(data.rfind(b"\n") + 1)
        f = _open_raw(p, "ab")
        self._good = f.seek(0, os.SEEK_END)
        return f

    # writing ---------------------------------------------------------------------------------
    def write(self, record: Mapping[str, Any] | Any) -> None:
        """Append one step (a mapping or dataclass; unknown keys ignored) in one system call.

        A write the disk refuses is cut back to the last whole row; then ``on_error`` decides (see the class)."""
        line = format_row(record, self.columns)
        rec = _as_mapping(record)
        step = rec.get("step")
        if self._skip > 0:  # rows are being lost: try again only now and then
            self._skip -= 1
            self._lose(step, None, len(line))
            return
        data = b""
        try:
            if self._f is None:
                self._f = self._open(int(step) if step is not None else 0)
            data = self._pending + line.encode("utf-8")
            n = self._f.write(data)
            if n != len(data):  # a short write: the disk filled up within this line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if self.fsync:
                os.fsync(self._f.fileno())
        except OSError as e:
            self._cut_back()
            self._lose(step, e, len(data) or len(line))
            return
        self._good += len(data)
        self._pending = b""
        if self.lost_steps and self._gap > 1:
            first, last = self.lost_steps[-1]
            say("ampdoctor: the step log %s is written again from step %s (steps %s..%s were lost)",
                self.path, step, first, last)
        self._gap = 1
        self.rows_written += 1

    def _cut_back(self) -> None:
        """Cut the file back to its last whole row (a failed write may have left part of a line)."""
        if self._f is None:
            return
        try:
            os.ftruncate(self._f.fileno(), self._good)
        except OSError:
            pass

    def _lose(self, step: Any, e: OSError | None, size: int) -> None:
        s = int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step) else -1
        if e is not None and self.on_error == "raise":
            self._close_quietly()
            if self._created:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            raise OutputError(write_failure(self.path, e, size, what=f"the step log {self.path} at step {s}")) from None
        self.rows_lost += 1
        if self.lost_steps and self.lost_steps[-1][1] in (s - 1, s):
            self.lost_steps[-1] = (self.lost_steps[-1][0], s)
        else:
            self.lost_steps.append((s, s))
        if e is None:
            return
        self._skip = self._gap
        self._gap = min(self._gap * 2, RETRY_MAX_GAP)
        if self._warned:
            return
        self._warned = True
        why = write_failure(self.path, e, size, what="-").removeprefix("cannot write -: ").split("; ", 1)[0]
        msg = (f"ampdoctor: rows of the step log {self.path} are being lost from step {s} on ({why}); training goes on, "
               "and writing is tried again now and then: free some space, or pass another log path")
        say(msg, warned=True)  # the ampdoctor logger (its default stderr handler leaves it to the warning)
        warn_user(msg, StepLogWarning)  # pointing at the user's line

    def _close_quietly(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()

    def close(self) -> None:
        """Close the file; never raises. Rows that were lost are named once more (the ``ampdoctor`` logger)."""
        self._close_quietly()
        if self.rows_lost and not self._summarised:
            self._summarised = True
            spans = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in self.lost_steps[:5])
            more = f" and {len(self.lost_steps) - 5} more runs" if len(self.lost_steps) > 5 else ""
            say("ampdoctor: the step log %s misses %d row(s) it could not write: steps %s%s",
                self.path, self.rows_lost, spans, more)

    def __enter__(self) -> StepLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
