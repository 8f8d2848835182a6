"""The report's key pictures as Unicode text, for a Markdown report pasted into a ticket without its PNGs:
FP16 headroom per layer (a bar per row) and GradScaler's scale over the steps (columns of block characters)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ampdoctor.fmt import pow2, steps

EIGHTHS = " ▏▎▍▌▋▊▉█"
"""Horizontal bars in eighths of a character."""
LEVELS = " ▁▂▃▄▅▆▇█"
"""Vertical columns in eighths of a character."""
MARK = "◀ verdict"


def _hbar(x: float, width: int) -> str:
    n = max(0.0, min(float(width), x)) * 8
    full, part = divmod(round(n), 8)
    return "█" * int(full) + (EIGHTHS[int(part)] if part else "")


def headroom(rows: Sequence[tuple[str, float, bool]], width: int = 32) -> list[str]:
    """(label, headroom in binades, the verdict's row) → one line each: the label, the value, a bar as long as
    the headroom (a row below 0 overflows FP16 and says so), the verdict's rows marked."""
    if not rows:
        return []
    top = max((h for _, h, _ in rows if math.isfinite(h)), default=1.0)
    top = max(top, 1.0)
    name_w = max(len(n) for n, _, _ in rows)
    out = [f"FP16 headroom per layer, in binades (log2(65504 / FP32 absmax)); {'█' * 1} = {top / width:.2g} binades"]
    for name, h, mine in rows:
        if not math.isfinite(h):
            bar, val = "(no non-zero value)", "inf"
        elif h < 0:
            bar, val = "✗ overflows FP16", f"{h:.1f}"
        else:
            bar, val = _hbar(h / top * width, width), f"{h:.1f}"
        line = f"{name.ljust(name_w)} {val.rjust(5)} {bar}"
        out.append((line.ljust(name_w + 7 + width) + "  " + MARK) if mine else line)
    return out


def _bucket(xs: Sequence[float], width: int) -> tuple[list[float], int]:
    """At most ``width`` columns: the smallest value of each run of ``per`` steps (a skip's drop stays visible)."""
    per = max(1, math.ceil(len(xs) / width))
    return [min(xs[i:i + per]) for i in range(0, len(xs), per)], per


def scale_history(scales: Sequence[float | None], skipped: Sequence[int], first: int, verdict_step: int | None,
                  height: int = 4, width: int = 64) -> list[str]:
    """GradScaler's scale over the steps (from step ``first``), log2, as ``height`` rows of block columns; under
    it a row marking the skipped steps (×) and the verdict's step (▲)."""
    pts = [math.log2(x) if x is not None and x > 0 else math.nan for x in scales]
    finite = [p for p in pts if math.isfinite(p)]
    if not finite:
        return []
    cols, per = _bucket([p if math.isfinite(p) else min(finite) for p in pts], width)
    lo, hi = min(finite), max(finite)
    if hi == lo:
        height = 1  # one scale throughout: one row says it
    span = max(hi - lo, 1.0)
    levels = [round((c - lo) / span * (height * 8 - 1)) + 1 for c in cols]  # 1 .. height*8: a column is never empty
    rows = []
    for r in range(height - 1, -1, -1):
        rows.append("".join(LEVELS[max(0, min(8, lv - 8 * r))] for lv in levels))
    skip = set(skipped)
    marks = []
    for i in range(len(cols)):
        span_steps = range(first + i * per, first + (i + 1) * per)
        if verdict_step is not None and verdict_step in span_steps:
            marks.append("▲")
        elif any(s in skip for s in span_steps):
            marks.append("×")
        else:
            marks.append(" ")
    last = first + len(scales) - 1
    each = "one column per step" if per == 1 else f"one column per {per} steps, their lowest scale"
    which = f"steps {first}-{last} ({each})" if last > first else f"step {first}"
    head = (f"GradScaler scale, {which}: top {pow2(2.0 ** hi)}, bottom {pow2(2.0 ** lo)}"
            if hi != lo else f"GradScaler scale, {which}: {pow2(2.0 ** hi)} throughout")
    legend = f"× skipped ({steps(sorted(skip))})" + (f", ▲ the verdict's step {verdict_step}" if verdict_step is not None else "")
    return [head, *(f"{lab} {row}".rstrip() for lab, row in zip(_axis(hi, lo, height), rows, strict=True)),
            f"{' ' * len(_axis(hi, lo, height)[0])} {''.join(marks).rstrip()}", legend]


def _axis(hi: float, lo: float, height: int) -> list[str]:
    """Row labels: the top scale on the first row, the bottom one on the last, blank between."""
    top, bottom = pow2(2.0 ** hi), pow2(2.0 ** lo)
    w = max(len(top), len(bottom))
    labels = [""] * height
    labels[0], labels[-1] = top, bottom if height > 1 else top
    return [lab.rjust(w) for lab in labels]
