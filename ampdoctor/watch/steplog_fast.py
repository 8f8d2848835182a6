"""The fast path of ``read_step_log``: one vectorised pandas read for a clean log.

A log of a million steps read field by field takes half a minute; read by pandas' C parser with
the column types given it takes about a second. This path accepts only what the validating reader
would accept unchanged (no quotes, the header's width on every row, integer steps, numbers or
``nan``/``inf`` where numbers belong, 0/1-like skip flags) and returns None for anything else, so
the validating reader, with its one-line error naming the row, handles every log that is not clean.
"""

from __future__ import annotations

import csv
import io
import itertools
from collections.abc import Collection

import numpy as np
import pandas as pd

_NAN = ["".join(c) for c in itertools.product(*("nN", "aA", "nN"))]
"""Every spelling of nan the validating reader accepts (case-insensitive)."""


def _same_width(text: str, width: int) -> bool:
    """Every non-blank line has ``width - 1`` commas (there are no quotes, so every comma separates)."""
    b = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    ends = np.flatnonzero(b == ord("\n"))
    if ends.size == 0 or ends[-1] != b.size - 1:
        ends = np.append(ends, b.size)
    commas = np.searchsorted(np.flatnonzero(b == ord(",")), ends)
    per_line = np.diff(commas, prepend=0)
    starts = np.concatenate([[0], ends[:-1] + 1])
    blank = (ends - starts) == 0
    blank |= ((ends - starts) == 1) & (b[np.minimum(starts, b.size - 1)] == ord("\r"))
    return bool(((per_line == width - 1) | (blank & (per_line == 0))).all())


def read_clean(text: str, required: Collection[str], numeric: Collection[str], may_be_empty: Collection[str],
               true: Collection[str], false: Collection[str]) -> pd.DataFrame | None:
    """The frame ``read_step_log`` builds (before de-duplication), or None when the log needs the validating reader."""
    if '"' in text or "\t" in text:
        return None
    header = next(csv.reader([text.split("\n", 1)[0].rstrip("\r")]), [])
    names = [h.strip() for h in header]
    if not names or len(set(names)) != len(names) or any(h != n for h, n in zip(header, names, strict=True)):
        return None
    if any(c not in names for c in required):
        return None
    if not _same_width(text, len(names)):
        return None
    dtype: dict[str, object] = {c: str for c in names if c != "step"}
    dtype.update({c: "float64" for c in numeric})
    na: dict[str, list[str]] = {c: _NAN + ([""] if c in may_be_empty else []) for c in numeric}
    try:
        df = pd.read_csv(io.StringIO(text), dtype=dtype, keep_default_na=False, na_values=na,  # type: ignore[arg-type]
                         skipinitialspace=True, index_col=False)
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError):
        return None
    if len(df) == 0 or df["step"].dtype.kind not in "iu":
        return None
    if df["step"].dtype.kind == "u" and int(df["step"].max()) > np.iinfo(np.int64).max:
        return None  # would wrap around int64: the validating reader refuses it, naming the row
    if (df["step"] < 0).any():
        return None
    df["step"] = df["step"].astype("int64")
    flags = df["skipped"]
    is_true = flags.isin(list(true))
    if not (is_true | flags.isin(list(false))).all():
        return None
    df["skipped"] = is_true
    return df
