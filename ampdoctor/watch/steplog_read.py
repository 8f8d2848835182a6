"""Reading a step log (``watch.steplog`` writes it): ``read_step_log`` validates a whole CSV into a ``StepLog``
(every column checked, a step that appears twice keeps its last row, and says so), and ``StepLogStream`` reads one
row at a time in bounded memory for a log too long to hold (``ampdoctor scaler`` on millions of steps)."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampdoctor.watch.steplog import COLUMNS, MAY_BE_EMPTY, NUMERIC, StepLogError


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
