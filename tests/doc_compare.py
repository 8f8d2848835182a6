"""Compare a docs output block with what the command prints today: text exactly, numbers within what
the arithmetic supports.

A figure such as the smallest non-zero |x| of a tensor comes from a near-cancellation, so its last
digits depend on the summation order of the CPU's kernels (``ATEN_CPU_CAPABILITY``). Everything
else must hold exactly: the words, the names, the order of the rows, the number of lines.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"(?<![\w.^])(?<!\^-)(?<!\^\+)[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?%?(?![\w^])")
"""A printed number (``7.571e+04``, ``0.0488%``, ``-0.2``); not a part of a name (``blocks.1``), nor
an exponent of ``2^-3``, which is a scale and must match exactly."""

FP16_EPS = 2.0**-10
"""FP16's relative precision: two values closer than this are the same FP16 number."""
FP16_TINY = 2.0**-14
"""FP16's smallest normal number: differences below it are below FP16's normal range."""


def _value(tok: str) -> tuple[float, float]:
    """(value, half a unit of its last printed digit) of a printed number."""
    pct = tok.endswith("%")
    s = tok[:-1] if pct else tok
    mant, _, exp = s.lower().partition("e")
    decimals = len(mant.partition(".")[2])
    half = 0.5 * 10.0 ** (-decimals) * 10.0 ** int(exp or 0)
    v = float(s)
    return (v / 100, half / 100) if pct else (v, half)


def numbers_close(a: str, b: str) -> bool:
    """Two printed numbers agree within their printing precision plus FP16's precision; a number
    printed without a point or an exponent (a count, a step) must be the same."""
    if re.fullmatch(r"[-+]?\d+%?", a) or re.fullmatch(r"[-+]?\d+%?", b):
        return a == b
    (x, hx), (y, hy) = _value(a), _value(b)
    return abs(x - y) <= hx + hy + FP16_EPS * max(abs(x), abs(y)) + FP16_TINY


def skeleton(line: str) -> str:
    """A line with its numbers replaced by '#' and runs of spaces collapsed."""
    return " ".join(NUMBER.sub("#", line).split())


def differences(expected: str, actual: str) -> list[str]:
    """What differs between a docs block and today's output ([] when they agree)."""
    e, a = expected.rstrip("\n").splitlines(), actual.rstrip("\n").splitlines()
    if len(e) != len(a):
        return [f"{len(e)} lines in the docs, {len(a)} printed today"]
    out = []
    for i, (le, la) in enumerate(zip(e, a, strict=True), 1):
        if skeleton(le) != skeleton(la):
            out.append(f"line {i}: docs {le.strip()!r} / today {la.strip()!r}")
            continue
        for ne, na in zip(NUMBER.findall(le), NUMBER.findall(la), strict=True):
            if not numbers_close(ne, na):
                out.append(f"line {i}: {ne} in the docs, {na} today")
    return out
