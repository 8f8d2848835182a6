"""Small formatting helpers shared by the renderers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from ampdoctor.fmt import num, option_value, pct, pow2, steps

__all__ = ["CAUSE_TITLES", "history", "listed", "num", "option_value", "pct", "scale", "scaled_stage", "skip_reasons", "steps"]

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
    "not_reproduced": "Not reproduced (transient)",
    "compile_numerics": "Compiled numerics (torch.compile only)",
    "replay_mismatch": "Replay ran another model",
}


def scale(x: float | None) -> str:
    """A loss scale: 2^k for a power of two, else the number."""
    return pow2(x)


def spec_name(report: Any) -> str:
    """The spec's file name ('forward_overflow.py'), or '' without one."""
    spec = str(report.config.get("spec") or "")
    return spec.replace("\\", "/").rsplit("/", 1)[-1]


def ran_steps(report: Any) -> int | None:
    """The most steps a stage ran (the FP32 reference's, usually)."""
    return max((s.steps_run for s in report.stages), default=None)


def step0(report: Any) -> int:
    """The run's number of the report's first step (a replay or a checkpoint start; else 0)."""
    return int(report.config.get("step0") or 0)


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


def calibration_line(sc: Any) -> str:
    """The count of GradScaler's calibration skips, as the scaler section says it: the skips of the scale's first
    descent that were gradient overflows. A skip that follows a non-finite loss (a forward overflow) is not
    calibration, whatever the scale did, and the section's words count it apart: both say the same number."""
    first = sc.skips[: sc.calibration_skips]
    grad = sum(1 for e in first if not str(e.reason).startswith("nonfinite_loss"))
    if grad == len(first):
        return str(sc.calibration_skips)
    n = len(first) - grad
    return (f"{grad} ({n} more of the first {len(first)} skips {'follows' if n == 1 else 'follow'} a non-finite loss: "
            "not calibration)")


def history(report: Any) -> Any:
    """The lookback ring's story of the steps before a captured failure (the finding of code 'history'), or None."""
    return next((f for f in report.findings if f.code == "history"), None)


def listed(report: Any) -> list[Any]:
    """The findings the Evidence and Warnings sections list (the story has its own section)."""
    return [f for f in report.findings if f.code != "history"]
