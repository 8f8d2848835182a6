"""The English of the compile rung (``judge.compiled``): the ``compile_numerics`` verdict, its findings and fixes.

``report.words.verdicts`` (``SUMMARIES``, ``RULE_TITLES``), ``findings`` (``FINDINGS``) and ``fixes`` (``FIXES``) merge these
dictionaries into their own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ampdoctor.fmt import gen
from ampdoctor.records import Finding, ScalerStory

Facts = Mapping[str, Any]

STAGES = {"graph_capture": "Dynamo's graph capture", "aot_autograd": "AOT autograd", "inductor_codegen": "Inductor's generated code"}


def _op(f: Facts) -> str:
    """' at nan_to_num (model.py:14, in mlp), non-finite in 7 element(s) compiled and 0 eager'."""
    op = f.get("op")
    if not op:
        return ""
    where = ", ".join(x for x in (op.get("line"), f"in {op['module']}" if op.get("module") else None) if x)
    return (f"; the first op of the graph whose compiled output differs from eager's is {op['op']}"
            + (f" ({where})" if where else "")
            + f": {op['compiled_nonfinite']} non-finite element(s) compiled against {op['eager_nonfinite']} eager"
            + (f", largest finite |x| {gen(op['compiled_absmax'])} against {gen(op['eager_absmax'])}"
               if op.get("compiled_absmax") == op.get("compiled_absmax") and op.get("eager_absmax") == op.get("eager_absmax")
               else ""))


def _emulate(f: Facts) -> str:
    if f.get("emulate_fixes") is None:
        return ""
    if f["emulate_fixes"]:
        return (". With emulate_precision_casts (each fused intermediate rounded to the low-precision dtype as eager "
                "rounds it) the compiled step is finite: Inductor keeps a fused intermediate in FP32 that eager rounds")
    return ". With emulate_precision_casts it still fails: not (only) the precision Inductor keeps inside a fused kernel"


def _summary(f: Facts) -> str:
    before = f": backend {f['backend']} fails" + (f", {f['previous']} stays finite" if f.get("previous") else "")
    return (f"The compiled model goes non-finite at step {f['step']} in {f['target']} while eager PyTorch stays finite on "
            f"the same weights and batch: it starts in {STAGES[f['stage']]}{before}{_op(f)}{_emulate(f)}.")


SUMMARIES: dict[str, Callable[[Facts], str]] = {"compile_numerics": _summary}

RULE_TITLES: dict[str, Callable[[Facts], str]] = {
    "compile_numerics": lambda f: (
        f"only the compiled model goes non-finite at step {f['step']}: the failure starts in {STAGES[f['stage']]}"),
}


def _disable(f: Facts) -> str:
    what = f"{f['module']}'s forward" if f.get("module") else f"the function that runs {f.get('op') or 'the op'}"
    at = f" ({f['line']})" if f.get("line") else ""
    return (f"Keep {what}{at} out of the compiled graph: decorate it with @torch.compiler.disable (the rest of the model "
            "stays compiled).")


FIXES: dict[str, Callable[[Facts], str]] = {
    "compile_emulate_casts": lambda f: (
        "Set torch._inductor.config.emulate_precision_casts = True before torch.compile: Inductor then rounds fused "
        "intermediates to the low-precision dtype as eager PyTorch does (the replay is finite with it)."),
    "compile_disable": _disable,
    "compile_backend": lambda f: (
        f"Or compile with backend='{f['backend']}', which stays finite on this step (without the later compiler stages' "
        "speed-up)."),
}


def _runs(f: Finding) -> str:
    return "; ".join(f.evidence.get("runs") or [])


FINDINGS: dict[str, Callable[[Finding, ScalerStory | None], tuple[str, str]]] = {
    "compile_eager_fails": lambda f, s: (
        f"the compiled stage fails at step {f.step}, and so does eager PyTorch (or the eager verdict above is not "
        f"healthy): not a compile problem ({_runs(f)})",
        "Fix the eager failure first; then rerun triage --compile."),
    "compile_not_reproduced": lambda f, s: (
        f"the compiled stage fails at step {f.step}, but no backend fails when that step is replayed alone at unit loss "
        f"scale ({_runs(f)})",
        "A failure of the compiled run that a replay of its step does not repeat: rerun triage --compile with more steps."),
}
