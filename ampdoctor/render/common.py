"""Small formatting helpers shared by the renderers."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

CAUSE_TITLES = {
    "healthy": "Healthy",
    "data": "Data problem",
    "model_bug": "Model bug (fails in FP32 too)",
    "fp16_forward_overflow": "FP16 forward overflow",
    "fp16_grad_overflow": "FP16 gradient overflow",
    "fp16_grad_underflow": "FP16 gradient underflow",
    "fp16_update_swallowed": "FP16 updates swallowed",
    "amp_misuse": "AMP misuse",
    "inconclusive": "Inconclusive",
}


def num(x: Any, digits: int = 4) -> str:
    """A compact number: 4 significant digits, powers of two for scales, '-' for None."""
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


def scale(x: float | None) -> str:
    if x is None:
        return "-"
    if x > 0 and math.isfinite(x):
        k = math.log2(x)
        if k == int(k):
            return f"2^{int(k)}"
    return num(x)


def pct(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if x < 0.001:
        return "<0.1%"
    return f"{x:.1%}"


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


def evidence(ev: dict[str, Any]) -> str:
    return "; ".join(f"{k}={num(v) if not isinstance(v, (list, dict)) else v}" for k, v in ev.items())


def option_value(v: Any) -> str:
    """An option's value as typed on the command line: 0.5, fp16,bf16, auto."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def scaled_stage(report: Any) -> Any:
    """The stage that ran a GradScaler (the one with scales), or None."""
    return next((s for s in report.stages if any(x is not None for x in s.scales)), None)


def reason_label(reason: str, module: Callable[[str], str] = str) -> str:
    """'nonfinite grad at c_attn' for 'nonfinite_grad:c_attn': the code reads as words, the module name stays
    exact (its underscores too), formatted by ``module`` (a code span in Markdown)."""
    kind, sep, name = reason.partition(":")
    label = kind.replace("_", " ")
    return f"{label} at {module(name)}" if sep and name else label


def skip_reasons(skips: list[Any], module: Callable[[str], str] = str) -> str:
    """'18 × nonfinite grad at head, 2 × nonfinite loss' for a list of ScaleEvents."""
    reasons = Counter(x.reason or "unknown" for x in skips)
    return ", ".join(f"{n} × {reason_label(r, module)}" for r, n in reasons.most_common()) or "none"
