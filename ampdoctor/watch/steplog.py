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
  same header, and is appended to only by a run that resumes (its first step is not 0, e.g. after
  ``Monitor.load_state_dict``); a fresh run (first step 0) onto a log that has rows is refused.
  An incomplete last line (a process killed mid-write) is cut off first: it is not a finished step.
- ``"new"``: refuse if the file exists and is not empty.
- ``"overwrite"``: start the file afresh (the user said so, e.g. ``--force``).

The reader keeps the last row of a step that appears twice (a resumed run redid it) and says so.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from ampdoctor.errors import AmpDoctorError

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


class StepLogWriter:
    """Writes a step log line by line, flushing each line. Opens the file at the first ``write``.

    ``StepLogWriter(path).write({"step": 0, "lr": 1e-3, ..., "scaler_scale": 65536.0})``, or pass
    a dataclass instance with those fields. Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        extra_columns: Sequence[str] = (),
        mode: Mode = "append",
        fsync: bool = False,
    ) -> None:
        if mode not in ("append", "new", "overwrite"):
            raise StepLogError(f"mode must be 'append', 'new' or 'overwrite', not {mode!r}")
        dup = [c for c in extra_columns if c in COLUMNS]
        if dup:
            raise StepLogError(f"extra column(s) {', '.join(dup)} repeat the standard columns")
        self.path = Path(path)
        self.columns: tuple[str, ...] = COLUMNS + tuple(extra_columns)
        self.mode: Mode = mode
        self.fsync = fsync
        self._f: IO[str] | None = None
        self.rows_written = 0

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
        if first_step == 0 and rows > 0:
            raise StepLogError(
                f"{p} already holds {rows} step(s) and this run starts at step 0; write to another path, "
                "overwrite it on purpose (mode='overwrite'), or load the monitor's state_dict to resume"
            )
        return data

    def _open(self, first_step: int) -> IO[str]:
        p = self.path
        data = self._existing(first_step)
        if data is None:
            f = open(p, "w", encoding="utf-8", newline="")
            f.write(header_line(self.columns))
            f.flush()
            return f
        if not data.endswith(b"\n"):
            with open(p, "r+b") as fb:  # a half-written line is not a finished step
                fb.truncate(data.rfind(b"\n") + 1)
        return open(p, "a", encoding="utf-8", newline="")

    # writing ---------------------------------------------------------------------------------
    def write(self, record: Mapping[str, Any] | Any) -> None:
        """Append one step (a mapping or dataclass; unknown keys ignored) and flush it."""
        line = format_row(record, self.columns)
        if self._f is None:
            step = _as_mapping(record).get("step")
            self._f = self._open(int(step) if step is not None else 0)
        self._f.write(line)
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())
        self.rows_written += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

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


_TRUE = {"1", "true", "True", "TRUE", "1.0"}
_FALSE = {"0", "false", "False", "FALSE", "0.0"}


def read_step_log(path: str | Path) -> StepLog:
    """Read and validate a step log with pandas.

    Raises ``StepLogError`` naming the column or row (1-based data row, with its line number) that
    is wrong: a missing column, a non-numeric value, a non-integer step, a skipped flag not 0/1.
    """
    import pandas as pd

    p = Path(path)
    if not p.exists():
        raise StepLogError(f"{p} does not exist")
    if p.is_dir():
        raise StepLogError(f"{p} is a directory, not a step log CSV")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise StepLogError(f"{p} is not a text CSV ({e.reason} at byte {e.start})") from None
    notes: list[str] = []
    if not text.strip():
        raise StepLogError(f"{p} is empty; a step log starts with the header {','.join(COLUMNS)}")
    lines = text.split("\n")
    if not text.endswith("\n") and len(lines) > 2:
        header_n = len(next(csv.reader([lines[0]])))
        last_n = len(next(csv.reader([lines[-1]]), []))
        if last_n < header_n:
            notes.append(f"the last line ({len(lines)}) is incomplete (a run killed mid-write?) and was ignored")
            text = "\n".join(lines[:-1]) + "\n"
    from ampdoctor.watch.steplog_fast import read_clean

    clean = read_clean(text, COLUMNS, NUMERIC, MAY_BE_EMPTY, _TRUE, _FALSE)  # a clean log in one vectorised read
    if clean is not None:
        return _finish(clean, p, notes)
    rows = list(csv.reader(io.StringIO(text)))
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

    def where(i: int) -> str:
        return f"row {i + 1} (line {i + 2})"

    out = pd.DataFrame(index=df.index)
    steps = pd.to_numeric(df["step"].str.strip(), errors="coerce")
    bad = steps.isna() | (steps != steps.round())
    if bad.any():
        i = int(bad.to_numpy().nonzero()[0][0])
        raise StepLogError(f"{p}: column step, {where(i)}: {df['step'].iloc[i]!r} is not an integer step number")
    out["step"] = steps.astype("int64")
    for c in NUMERIC:
        raw = df[c].str.strip()
        vals = pd.to_numeric(raw, errors="coerce")  # reads nan, inf, -inf, Infinity too
        empty = raw == ""
        bad = vals.isna() & ~empty & (raw.str.lower() != "nan")
        if c not in MAY_BE_EMPTY:
            bad = bad | empty
        if bad.any():
            i = int(bad.to_numpy().nonzero()[0][0])
            raise StepLogError(f"{p}: column {c}, {where(i)}: {df[c].iloc[i]!r} is not a number")
        out[c] = vals.astype("float64")
    sk = df["skipped"].str.strip()
    bad = ~sk.isin(_TRUE | _FALSE)
    if bad.any():
        i = int(bad.to_numpy().nonzero()[0][0])
        raise StepLogError(f"{p}: column skipped, {where(i)}: {df['skipped'].iloc[i]!r} is not 0 or 1")
    out["skipped"] = sk.isin(_TRUE)
    out["skip_reason"] = df["skip_reason"].fillna("")
    for c in df.columns:
        if c not in out.columns:
            out[c] = df[c]
    out = out[list(df.columns)]  # the file's column order
    return _finish(out, p, notes)


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
