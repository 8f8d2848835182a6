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
from dataclasses import dataclass, field
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


# reading -------------------------------------------------------------------------------------

@dataclass
class StepLog:
    """A validated step log. ``frame`` has one row per step, sorted by step, with typed columns."""

    frame: Any  # pandas.DataFrame (pandas is imported lazily)
    path: Path
    notes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return self.frame["step"].astype("int64").tolist()  # type: ignore[no-any-return]

    @property
    def skipped(self) -> list[bool]:
        return self.frame["skipped"].astype(bool).tolist()  # type: ignore[no-any-return]

    @property
    def reasons(self) -> list[str]:
        return self.frame["skip_reason"].astype(str).tolist()  # type: ignore[no-any-return]

    @property
    def losses(self) -> list[float]:
        return self.frame["loss"].astype("float64").tolist()  # type: ignore[no-any-return]

    @property
    def scales(self) -> list[float] | None:
        """The scale column, or None when the run had no scaler (the column is empty)."""
        col = self.frame["scaler_scale"]
        if col.isna().all():
            return None
        if col.isna().any():
            return col.ffill().bfill().astype("float64").tolist()  # type: ignore[no-any-return]
        return col.astype("float64").tolist()  # type: ignore[no-any-return]


FIELD_LIMIT = csv.field_size_limit()
"""The longest field Python's csv reads (131072 characters); a step log's are a few dozen."""


def _csv_problem(text: str, e: csv.Error | None) -> str:
    """Which line of ``text`` the csv module cannot read, and why."""
    for n, line in enumerate(text.split("\n"), 1):
        if len(line) > FIELD_LIMIT:
            return f"line {n} is {len(line):,} characters long (more than {FIELD_LIMIT:,} in a field)"
    return f"the CSV cannot be read ({e})" if e is not None else "the CSV cannot be read"


_TRUE = {"1", "true", "True", "TRUE", "1.0"}
_FALSE = {"0", "false", "False", "FALSE", "0.0"}


def read_step_log(path: str | Path) -> StepLog:
    """Read and validate a step log with pandas.

    Raises ``StepLogError`` naming the column or row (1-based data row, with its line number) that
    is wrong: a missing column, a non-numeric value, a non-integer step, a skipped flag not 0/1.
    """
    p = Path(path)
    notes: list[str] = []
    text = _read_text(p, notes)
    from ampdoctor.watch.steplog_fast import read_clean

    try:
        clean = read_clean(text, COLUMNS, NUMERIC, MAY_BE_EMPTY, _TRUE, _FALSE)  # a clean log in one vectorised read
    except csv.Error:
        clean = None  # the validating reader names the line
    if clean is not None:
        return _finish(clean, p, notes)
    return _finish(_validated(_table(text, p), p), p, notes)


def _wide_encoding(p: Path) -> str | None:
    """'UTF-16 (little-endian)' and the like when the file's first bytes say so (a byte-order mark, or ASCII text
    with every other byte zero), else None."""
    try:
        with p.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    for bom, name in ((b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"), (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
                      (b"\xff\xfe", "UTF-16 (little-endian)"), (b"\xfe\xff", "UTF-16 (big-endian)")):
        if head.startswith(bom):
            return name
    even, odd = head[0::2], head[1::2]
    if len(head) >= 8 and odd.count(0) == len(odd) and 0 not in even:
        return "UTF-16LE"
    if len(head) >= 8 and even.count(0) == len(even) and 0 not in odd:
        return "UTF-16BE"
    return None


def _read_text(p: Path, notes: list[str]) -> str:
    """The log's text, its incomplete last line (a run killed mid-write) dropped and said in ``notes``."""
    if not p.exists():
        raise StepLogError(f"{p} does not exist")
    if p.is_dir():
        raise StepLogError(f"{p} is a directory, not a step log CSV")
    enc = _wide_encoding(p)
    if enc is not None:  # a log saved by an editor or PowerShell's `>` (UTF-16: ASCII with NULs is valid UTF-8)
        raise StepLogError(f"{p} is {enc} text, and step logs are read as UTF-8: convert it, e.g. `iconv -f "
                           f"{enc.split()[0]} -t UTF-8 {p.name} > {p.stem}.utf8{p.suffix}`")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise StepLogError(f"{p} is not a text CSV ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise StepLogError(f"{p} is empty; a step log starts with the header {','.join(COLUMNS)}")
    lines = text.split("\n")
    if max(len(x) for x in lines[:1] + lines[-1:]) > FIELD_LIMIT:
        raise StepLogError(f"{p}: {_csv_problem(text, None)}; this is not a step log (one row a step, the header "
                           f"{','.join(COLUMNS)})")
    if not text.endswith("\n") and len(lines) > 2:
        header_n = len(next(csv.reader([lines[0]])))
        last_n = len(next(csv.reader([lines[-1]]), []))
        if last_n < header_n:
            notes.append(f"the last line ({len(lines)}) is incomplete (a run killed mid-write?) and was ignored")
            text = "\n".join(lines[:-1]) + "\n"
    return text


def _table(text: str, p: Path) -> Any:
    """The CSV as text cells, every row as wide as the header and every column a step log needs there."""
    import pandas as pd

    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as e:
        raise StepLogError(f"{p}: {_csv_problem(text, e)}; this is not a step log (one row a step, the header "
                           f"{','.join(COLUMNS)})") from None
    width = len(rows[0]) if rows else 0
    for i, r in enumerate(rows[1:]):
        if r and len(r) != width:
            raise StepLogError(f"{p}: row {i + 1} (line {i + 2}) has {len(r)} fields; the header has {width}")
    try:
        df = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, skipinitialspace=True, index_col=False)
    except pd.errors.ParserError as e:
        raise StepLogError(f"{p}: {str(e).strip().splitlines()[-1]}") from None
    except pd.errors.EmptyDataError:
        raise StepLogError(f"{p} has no header; a step log starts with {','.join(COLUMNS)}") from None
    df.columns = [str(c).strip() for c in df.columns]
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise StepLogError(
            f"{p} is missing column(s) {', '.join(missing)}; a step log needs {', '.join(COLUMNS)}"
        )
    if len(df) == 0:
        raise StepLogError(f"{p} has a header but no steps")
    return df


def _where(i: int) -> str:
    return f"row {i + 1} (line {i + 2})"


def _first(bad: Any) -> int:
    return int(bad.to_numpy().nonzero()[0][0])


def _validated(df: Any, p: Path) -> Any:
    """The text cells as a step log's columns (int steps, float figures, bool skipped), the first bad cell named."""
    import pandas as pd

    out = pd.DataFrame(index=df.index)
    steps = pd.to_numeric(df["step"].str.strip(), errors="coerce")
    bad = steps.isna() | (steps != steps.round())
    if bad.any():
        i = _first(bad)
        raise StepLogError(f"{p}: column step, {_where(i)}: {df['step'].iloc[i]!r} is not an integer step number")
    # a 40-digit step would wrap around int64 (to -9223372036854775808): refuse it, and negative steps
    big = (steps.astype("float64") >= 2.0**63) | (steps < 0)
    if big.any():
        i = _first(big)
        shown = str(df["step"].iloc[i]).strip()
        shown = shown if len(shown) <= 24 else f"{shown[:12]}...({len(shown)} digits)"
        raise StepLogError(f"{p}: column step, {_where(i)}: {shown} is not a step number (0 to {2**63 - 1})")
    out["step"] = steps.astype("int64")
    for c in NUMERIC:
        raw = df[c].str.strip()
        vals = pd.to_numeric(raw, errors="coerce")  # reads nan, inf, -inf, Infinity too
        empty = raw == ""
        bad = vals.isna() & ~empty & (raw.str.lower() != "nan")
        if c not in MAY_BE_EMPTY:
            bad = bad | empty
        if bad.any():
            i = _first(bad)
            raise StepLogError(f"{p}: column {c}, {_where(i)}: {df[c].iloc[i]!r} is not a number")
        out[c] = vals.astype("float64")
    sk = df["skipped"].str.strip()
    bad = ~sk.isin(_TRUE | _FALSE)
    if bad.any():
        i = _first(bad)
        raise StepLogError(f"{p}: column skipped, {_where(i)}: {df['skipped'].iloc[i]!r} is not 0 or 1")
    out["skipped"] = sk.isin(_TRUE)
    out["skip_reason"] = df["skip_reason"].fillna("")
    for c in df.columns:
        if c not in out.columns:
            out[c] = df[c]
    return out[list(df.columns)]  # the file's column order


def _finish(out: Any, p: Path, notes: list[str]) -> StepLog:
    """Drop steps logged twice (the later row wins), sort by step, wrap."""
    dup = out["step"].duplicated(keep="last")
    if dup.any():
        notes.append(f"{int(dup.sum())} step(s) were logged twice (a resumed run?); the later rows are used")
        out = out[~dup]
    if not out["step"].is_monotonic_increasing:
        notes.append("rows were not in step order; sorted by step")
        out = out.sort_values("step", kind="stable")
    return StepLog(out.reset_index(drop=True), p, notes)


class NotStreamable(Exception):
    """The log needs the validating reader (quotes, a bad row, steps out of order or repeated): read it whole."""


class StepLogStream:
    """A step log read in blocks of about ``block_bytes``, each through the clean-log fast path, as typed frames.

    Memory stays at a block, whatever the log's length. Iterating raises ``NotStreamable`` where
    ``read_step_log`` would do more than read (a row it must name in an error, quotes, steps repeated by a
    resumed run or out of order, which it de-duplicates and sorts): the caller then reads the log whole.
    ``notes`` are ``read_step_log``'s (the incomplete last line), filled as the end is reached.
    """

    def __init__(self, path: str | Path, block_bytes: int = 4 << 20) -> None:
        self.path = Path(path)
        self.block_bytes = block_bytes
        self.notes: list[str] = []

    def __iter__(self) -> Any:
        from ampdoctor.watch.steplog_fast import read_clean

        p = self.path
        self.notes = []
        if not p.is_file():
            raise NotStreamable
        with open(p, "rb") as f:
            head = f.readline(FIELD_LIMIT + 2)
            if not head.endswith(b"\n") or len(head) > FIELD_LIMIT:
                raise NotStreamable
            try:
                header = head.decode("utf-8")
            except UnicodeDecodeError:
                raise NotStreamable from None
            width = len(next(csv.reader([header.rstrip("\r\n")]), []))
            rest = b""
            lines_before = 1  # lines of the file before the current block
            last_step: int | None = None
            any_rows = False
            while True:
                data = f.read(self.block_bytes)
                eof = not data
                buf = rest + data
                if not eof:
                    cut = buf.rfind(b"\n") + 1
                    if cut == 0:
                        rest = buf
                        continue
                    buf, rest = buf[:cut], buf[cut:]
                else:
                    rest = b""
                    if not buf:
                        break
                try:
                    text = buf.decode("utf-8")
                except UnicodeDecodeError:
                    raise NotStreamable from None
                if eof and not text.endswith("\n"):
                    last = text[text.rfind("\n") + 1:]
                    n_lines = lines_before + text.count("\n") + 1
                    if n_lines > 2 and len(next(csv.reader([last]), [])) < width:
                        self.notes.append(f"the last line ({n_lines}) is incomplete (a run killed mid-write?) and was ignored")
                        text = text[: len(text) - len(last)]
                lines_before += text.count("\n")
                if text.strip():
                    try:
                        df = read_clean(header + text, COLUMNS, NUMERIC, MAY_BE_EMPTY, _TRUE, _FALSE)
                    except csv.Error:
                        df = None
                    if df is None:
                        raise NotStreamable
                    st = df["step"].to_numpy()
                    if (last_step is not None and st[0] <= last_step) or (st.size > 1 and not (st[1:] > st[:-1]).all()):
                        raise NotStreamable
                    last_step = int(st[-1])
                    any_rows = True
                    yield df
                if eof:
                    break
            if not any_rows:
                raise NotStreamable
