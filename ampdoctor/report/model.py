"""The Report: plain data that every renderer reads. ``to_dict``/``from_dict`` round-trip."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from ampdoctor.records import Finding, LayerRow, ScaleEvent, ScalerStory, Verdict

SCHEMA_VERSION = 1

CAUSES = (
    "healthy",
    "data",
    "model_bug",
    "fp16_forward_overflow",
    "fp16_grad_overflow",
    "fp16_grad_underflow",
    "fp16_update_swallowed",
    "amp_misuse",
    "inconclusive",
    "not_reproduced",
    "compile_numerics",
    "replay_mismatch",
)






@dataclass
class StageSummary:
    name: str
    steps_run: int
    first_nonfinite_step: int | None
    skipped_steps: list[int]
    final_scale: float | None
    final_loss: float | None
    fp32_loss: float | None
    """FP32's loss at this stage's last step (same batch), for comparison."""
    losses: list[float]
    scales: list[float | None]
    grad_norms: list[float]
    error: dict[str, Any] | None = None
    stopped: str | None = None
    master_weights: bool = True




@dataclass
class LayerStep:
    """One module (or parameter) at one step of the target stage: the cells of the layers × steps heatmap."""

    module: str
    kind: str
    """activation | grad | param_grad | op (an operation inside the module, found by the FP32 op scan)"""
    step: int
    overflow_frac: float
    """Share of the FP32 stage's values at this step that overflow when cast to FP16."""
    underflow_frac: float
    """Share of the FP32 stage's values at this step that are non-zero and cast to 0 in FP16."""
    nonfinite_frac: float
    """Share of NaN/Inf in the target stage at this step."""
    flushed_frac: float
    """Share of FP32-non-zero elements that are zero in the target stage at this step."""
    absmax_fp32: float
    """Largest finite |x| in the FP32 stage at this step."""






@dataclass
class CodeFinding:
    """A mistake ``ampdoctor lint`` found in the spec (or the ``--script``) that triage ran."""

    path: str
    line: int
    col: int
    code: str
    """The lint rule (AMP001...)."""
    message: str
    fix: str
    explains: bool = False
    """The rule's mistake can cause the verdict of this report."""


@dataclass
class Report:
    verdict: Verdict
    stages: list[StageSummary]
    findings: list[Finding]
    layers: list[LayerRow]
    scaler: ScalerStory | None
    fixes: list[str]
    environment: dict[str, Any]
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    layer_steps: list[LayerStep] = field(default_factory=list)
    """Per step and module of the target stage (optional; filled by ``report_build.layer_steps``)."""
    lint: list[CodeFinding] = field(default_factory=list)
    """What ``ampdoctor lint`` found in the spec and ``--script`` (left out of the JSON when empty)."""
    schema_version: int = SCHEMA_VERSION
    tool: str = "ampdoctor triage"

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict.cause == "healthy" else 1

    def to_dict(self) -> dict[str, Any]:
        d = _clean(asdict(self))
        if not d["lint"]:
            del d["lint"]  # a report without code findings reads as it did before they existed
        return d  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        return _build(cls, d)


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/Inf floats become strings 'nan', 'inf', '-inf'."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _unclean(x: Any) -> Any:
    if x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, list):
        return [_unclean(v) for v in x]
    return x


_NESTED: dict[str, Any] = {}


def _build(cls: Any, d: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for name in (f.name for f in fields(cls)):
        if name not in d:
            continue
        v = d[name]
        t = _NESTED.get(f"{cls.__name__}.{name}")
        if t is not None and v is not None:
            v = [_build(t, x) for x in v] if isinstance(v, list) else _build(t, v)
        elif name in ("environment", "config", "evidence", "error"):
            pass
        else:
            v = _unclean(v)
        kwargs[name] = v
    return cls(**kwargs)


_NESTED.update({
    "Report.verdict": Verdict,
    "Report.stages": StageSummary,
    "Report.findings": Finding,
    "Report.layers": LayerRow,
    "Report.layer_steps": LayerStep,
    "Report.scaler": ScalerStory,
    "Report.lint": CodeFinding,
    "ScalerStory.skips": ScaleEvent,
})

assert all(is_dataclass(t) for t in _NESTED.values())
