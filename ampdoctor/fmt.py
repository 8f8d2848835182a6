"""One vocabulary for numbers in words: every renderer, the CLI tables and the rules' own
explanations format through these, so a scale reads ``2^16`` and a share ``3.1%`` everywhere."""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Mapping
from typing import Any


def num(x: Any, digits: int = 4) -> str:
    """A compact number: ``digits`` significant digits, '-' for None, nan/inf spelled out."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return f"{x:.{digits}g}"
    return str(x)


def short(x: float) -> str:
    """A number for a narrow table cell: 3 significant digits, or scientific outside [1e-3, 1e5)."""
    if isinstance(x, float) and math.isnan(x):
        return "-"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e5:
        return f"{x:.3g}"
    return f"{x:.1e}"


def pow2(x: float | None, op: str = "^") -> str:
    """``2^k`` for an exact power of two (``op="**"`` writes Python: ``2**k``); else the number.

    None and NaN are '-', 0 is '0', infinity 'inf'.
    """
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x == 0:
        return "0"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x > 0:
        k = math.log2(x)
        if k == int(k):
            return f"2{op}{int(k)}"
    return num(float(x)) if op == "^" else f"{x:g}"


def pct(x: float | None) -> str:
    """A share as a percentage with one decimal: '0', '<0.1%', '3.1%'; '-' for None."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if x < 0.001:
        return "<0.1%"
    return f"{x:.1%}"


def pct_short(x: float) -> str:
    """A share for a narrow table cell: 3 significant digits, '<.01%' below 1e-4."""
    if x == 0 or math.isnan(x):
        return "0"
    if x < 1e-4:
        return "<.01%"
    return f"{100 * x:.3g}%"


def steps(xs: list[int], limit: int = 12) -> str:
    """'0-3, 7, 9' for a sorted list of steps."""
    if not xs:
        return "none"
    runs: list[tuple[int, int]] = []
    for s in xs:
        if runs and s == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    more = f" (+{len(parts) - limit} more)" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


def option_value(v: Any) -> str:
    """An option's value as typed on the command line: 0.5, fp16,bf16, auto."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def command(tool: str, config: Mapping[str, Any], flags: Iterable[tuple[str, str]],
            ran_on: str | None = None) -> list[str] | None:
    """``ampdoctor TOOL SPEC`` and ``FLAG VALUE`` for each of ``flags`` (config key, flag) that ``config`` sets, shell
    quoted: the start of the command that reproduces a run (``--device auto`` → ``ran_on``, where it ran). None
    without a spec."""
    spec = config.get("spec")
    if not spec:
        return None
    parts = ["ampdoctor", tool, shlex.quote(str(spec))]
    for key, flag in flags:
        v = config.get(key)
        if key == "device" and v == "auto" and ran_on:
            v = ran_on
        if v is not None:
            parts += [flag, shlex.quote(option_value(v))]
    return parts


def pct0(x: float) -> str:
    """A share as a whole percentage: '42%' (for sentences; tables use ``pct``)."""
    return f"{x:.0%}"


def gen(x: float) -> str:
    """A number as Python's general format writes it: 65504, 1e-08, 0.5."""
    return f"{x:g}"


def fixed(x: float, digits: int = 2) -> str:
    """A number with a fixed number of decimals: 0.73."""
    return f"{x:.{digits}f}"


def sentences(parts: list[str]) -> str:
    """Clauses as sentences: each starts with a capital and ends with a full stop ('the scale fell' →
    'The scale fell.'); a clause that starts with code or a name (``init_scale=``) keeps its case."""
    out = []
    for p in parts:
        p = p.strip()
        if not p:
            continue
        head = p.split(" ", 1)[0]
        if head.isalpha() and head.islower():
            p = p[0].upper() + p[1:]
        out.append(p if p.endswith((".", "!", "?")) else p + ".")
    return " ".join(out)
