"""What a verdict learns from one more replay below the module: the autograd node, the masked attention rows.

``rules.judge`` names the module and the step; this adds, as facts and evidence (no words):

- for a gradient that went non-finite (``fp16_grad_overflow``, a ``model_bug`` found in backward): the first
  autograd node whose output gradient is non-finite, with the forward op, module and line that made it
  (``judge.gradnode``, replayed in the stage's precision at the step's loss scale);
- for a ``model_bug`` in backward inside a module whose softmax gets rows masked throughout: the rows, and the fix is
  the mask (a -inf row's softmax is NaN in every precision; hiding it from the forward with ``nan_to_num`` leaves the
  backward NaN);
- for an ``fp16_forward_overflow`` inside a module whose softmax gets rows finite in FP32 but beyond FP16's range
  throughout (a ``-1e9`` mask constant): those rows, and the fix is the constant (``torch.finfo(dtype).min``);
- for a target stage that raised because an op wrote a value FP16 cannot hold (``masked_fill(mask, -1e9)`` on FP16
  scores): the forward overflow it is (``fp16_forward_overflow``, variant ``fill_beyond``), naming the op.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from ampdoctor.judge.gradnode import GradNode
from ampdoctor.judge.opscan import MaskedRows, first_overflowing_op
from ampdoctor.records import MODEL, Finding, Fix, Outcome

if TYPE_CHECKING:
    from ampdoctor.judge.context import Ctx, Recheck


def masked_facts(mr: MaskedRows) -> dict[str, Any]:
    """A MaskedRows as the plain data of a verdict's facts and evidence."""
    out: dict[str, Any] = {"op": mr.op, "rows": mr.rows, "first": list(mr.first), "samples": list(mr.samples)}
    if mr.value is not None:
        out["value"] = mr.value
    return out


def _backward_replay(c: Ctx, out: Outcome) -> tuple[Recheck | None, float]:
    """The replay of the failing step a gradient fault is judged on, and the loss scale it ran at."""
    if out.step is None:
        return None, 1.0
    if out.cause == "fp16_grad_overflow" and c.tgt is not None and out.stage == c.tgt_name:
        rec = next((r for r in c.tgt.records if r.step == out.step), None)
        scale = rec.scaler_scale if rec is not None and rec.scaler_scale else 1.0
        return (c.rc if out.step == c.bad else c.recheck(c.tgt_name, out.step)), float(scale)
    if out.cause == "model_bug" and out.facts.get("variant") == "fp32_bug" and out.facts.get("where") == "backward":
        return c.recheck("initial", out.step), 1.0
    return None, 1.0


def _with_grad_node(c: Ctx, out: Outcome) -> Outcome:
    rc, scale = _backward_replay(c, out)
    node = rc.grad_node(scale) if rc is not None and rc.grad_node is not None else None
    if node is None:
        return out
    gn = asdict(node)
    out.facts["grad_node"] = gn
    out = _named_by_node(out, node)
    if out.findings:
        out.findings[0].evidence.update(grad_node=node.node, grad_op=node.op, grad_line=node.line,
                                        grad_module=node.module, grad_summed=node.summed)
    if out.cause == "model_bug" and rc is not None and rc.masked is not None and out.module and "masked" not in out.facts:
        mr = rc.masked(out.module)
        if mr is not None:  # masked rows whose gradients poison the batch: the fix is the mask, not a guard
            mf = masked_facts(mr)
            out.facts["masked"] = mf
            if out.findings:
                out.findings[0].evidence["fully_masked_rows"] = mf
            fixes = [f for f in out.fixes if f.code != "guard_op"]
            return replace(out, fixes=[Fix("unmask_row", {"module": out.module, **mf}), *fixes])
    return out


def _named_by_node(out: Outcome, node: GradNode) -> Outcome:
    """The node's module when the module-level answer lies strictly inside it: the node was made by the enclosing
    module's own code, and the child named only received its non-finite gradient (the module rules see module
    boundaries: a module whose inputs carry no gradient, the data, and whose own op breaks shows no outgoing fault)."""
    m = node.module
    if node.summed or m is None or m == MODEL or not out.module or not out.module.startswith(m + "."):
        return out
    out.facts["module_received"] = out.module
    if out.facts.get("module") == out.module:
        out.facts["module"] = m
    for f in out.findings:
        if f.module == out.module:
            f.module = m
    fixes = [replace(fx, facts={**fx.facts, "module": m}) if fx.facts.get("module") == out.module else fx for fx in out.fixes]
    return replace(out, module=m, fixes=fixes)


def _with_mask_constant(c: Ctx, out: Outcome) -> Outcome:
    if out.cause != "fp16_forward_overflow" or not out.module or out.step is None:
        return out
    rc = c.rc if out.stage == c.tgt_name and out.step == c.bad else None
    mr = rc.masked_beyond(out.module) if rc is not None and rc.masked_beyond is not None else None
    if mr is None:
        return out
    mf = masked_facts(mr)
    out.facts["mask_constant"] = mf
    if out.findings:
        out.findings[0].evidence["rows_beyond_fp16"] = mf
    return replace(out, fixes=[Fix("mask_constant", {"module": out.module, **mf}), *out.fixes])


def _raised_fill(c: Ctx, out: Outcome) -> Outcome:
    """A stage that raised because an op wrote a value FP16 cannot hold into an FP16 tensor (``masked_fill(mask, -1e9)``
    on FP16 scores: PyTorch refuses the cast) overflowed FP16 in the forward: the op the FP32 scan finds reaching
    FP16's overflow threshold inside the module names it."""
    f = out.facts
    if (out.cause != "amp_misuse" or f.get("variant") != "target_raised" or not out.module or out.step is None
            or "without overflow" not in str(f.get("message", ""))):
        return out
    rc = c.recheck(c.tgt_name, out.step) or c.recheck("initial", out.step)
    op = first_overflowing_op(rc.ops(out.module)) if rc is not None and rc.ops is not None else None
    if op is None:
        return out
    facts: dict[str, Any] = {"variant": "fill_beyond", "stage": out.stage, "step": out.step, "module": out.module,
                             "op": op.op, "fp32_absmax": op.absmax, "message": f.get("message"), "device": f.get("device")}
    ev = {"error": f"{f.get('type')}: {f.get('message')}", "op": op.op, "fp32_absmax": op.absmax,
          "op_overflow_frac": op.overflow_frac}
    fixes = [Fix("mask_constant", {"module": out.module}),
             Fix("keep_fp32_forward", {"module": out.module, "device": str(f.get("device", "cpu")).split(":")[0]})]
    return Outcome("fp16_forward_overflow", out.module, out.step, out.stage, facts,
                   [Finding("fp16_forward_overflow", "error", stage=out.stage, module=out.module, step=out.step,
                            evidence=ev)], fixes)


def refine(c: Ctx, out: Outcome) -> Outcome:
    """``out`` with what one more replay below its module finds (the autograd node, the masked rows), or as it is."""
    try:
        return _raised_fill(c, _with_mask_constant(c, _with_grad_node(c, out)))
    except Exception:  # a replay of the user's model that breaks takes nothing from the verdict already reached
        return out
