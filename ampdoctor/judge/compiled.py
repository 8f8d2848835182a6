"""The compile rung's verdict: ``compile_numerics`` when the compiled model fails on a step that eager PyTorch runs
finite from the same weights and batch, in the same precision; otherwise a finding beside the eager verdict.

The facts come from ``engine.compiled.CompileBisect.as_facts`` (plain data): the replays (eager, then each backend),
the compiler stage where the failure starts, whether Inductor emulating eager's casts is finite, and the first op of
the graph whose compiled output differs from eager's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ampdoctor.records import Finding, Fix, Outcome

PREVIOUS = {"graph_capture": None, "aot_autograd": "eager", "inductor_codegen": "aot_eager"}
"""The backend one stage before the one that fails (finite on the replay): a fix that gives up the later stages."""


def compile_outcome(out: Outcome, facts: dict[str, Any] | None, target: str) -> Outcome:
    """``out`` (the eager verdict) with the compile rung's word: ``compile_numerics`` when only the compiled model
    fails and the eager target is healthy; else ``out`` with a finding saying why it is not a compile problem."""
    if facts is None:
        return out
    step = int(facts["step"])
    ev = {"step": step, "stage": facts.get("stage"), "backend": facts.get("backend"),
          "runs": [f"{r['backend']}{'+emulate_precision_casts' if r['emulate_precision_casts'] else ''}: "
                   f"{'finite' if r['ok'] else 'fails'}" for r in facts["runs"]]}
    if facts["eager_fails"] or out.cause != "healthy":
        note = Finding("compile_eager_fails", "info", stage="compile", step=step, evidence=ev)
        return replace(out, findings=[*out.findings, note])
    if facts.get("stage") is None:
        note = Finding("compile_not_reproduced", "info", stage="compile", step=step, evidence=ev)
        return replace(out, findings=[*out.findings, note])
    op = facts.get("op") or {}
    module = op.get("module")
    f = {"variant": "compile_numerics", "step": step, "target": target, "stage": facts["stage"], "backend": facts["backend"],
         "previous": PREVIOUS.get(str(facts["stage"])), "emulate_fixes": facts.get("emulate_fixes"), "op": op or None,
         "module": module}
    if op:
        ev.update(op=op.get("op"), line=op.get("line"), code=op.get("code"),
                  eager_nonfinite=op.get("eager_nonfinite"), compiled_nonfinite=op.get("compiled_nonfinite"))
    fixes = []
    if facts.get("emulate_fixes"):
        fixes.append(Fix("compile_emulate_casts"))
    fixes.append(Fix("compile_disable", {"module": module, "line": op.get("line"), "op": op.get("op")}))
    if f["previous"] is not None:
        fixes.append(Fix("compile_backend", {"backend": f["previous"]}))
    finding = Finding("compile_numerics", "error", stage="compile", module=module, step=step, evidence=ev)
    return Outcome("compile_numerics", module, step, "compile", f, [finding, *[x for x in out.findings if x.severity != "error"]],
                   fixes)
