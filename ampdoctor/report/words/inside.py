"""The sentences about what happens inside a module: the autograd node where a gradient first went non-finite, and
the attention rows a mask leaves with no key (``judge.refine``'s facts)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ampdoctor.fmt import gen

Facts = Mapping[str, Any]


def _where(g: Facts) -> str:
    m = g.get("module")
    return "the loss function" if m is None else "the model's own forward" if m == "<model>" else m


def grad_node(f: Facts) -> str:
    """' In backward, the first non-finite gradient ...' for facts holding a ``grad_node``, else ''."""
    g = f.get("grad_node")
    if not g:
        return ""
    what = "NaN" if g.get("nan") else "Inf"
    made = (f"the backward of {g['op']}" if g.get("op") else "a node no recorded op made") + (
        f" at {g['line']}" if g.get("line") else "") + f" in {_where(g)}"
    cast = " (a dtype cast: the gradient goes back to the narrower dtype there and leaves its range)" if g["node"] == "ToCopyBackward0" else ""
    if g.get("summed"):
        return (f" In backward, the gradient {g['node']} ({made}) receives is already {what}, made by no node: it is the "
                "sum of the finite gradients of the ops that read that tensor.")
    return f" In backward, the first {what} gradient is made by {g['node']}, {made}{cast}, from finite gradients."


def samples(m: Facts) -> str:
    """', in sample(s) 2, 5' for masked rows' facts that name their samples, else ''."""
    s = m.get("samples")
    return f", in sample(s) {', '.join(str(i) for i in s)}" if s else ""


def mask_constant(f: Facts) -> str:
    """' Its softmax gets N row(s) ... -inf in FP16' for facts holding a ``mask_constant``, else ''."""
    m = f.get("mask_constant")
    if not m:
        return ""
    value = f" (every entry at most {gen(m['value'])})" if m.get("value") is not None else ""
    return (f" Its {m['op']} gets {m['rows']} row(s) masked throughout with a constant beyond FP16's range{value}, first "
            f"at index {tuple(m['first'])}{samples(m)}: finite in FP32, -inf throughout in FP16, and a softmax over a "
            "row of -inf is 0/0 = NaN.")


def extra(f: Facts) -> str:
    """What the verdict's summary adds from below the module."""
    return mask_constant(f) + grad_node(f)


FIXES: dict[str, Callable[[Facts], str]] = {
    "mask_constant": lambda f: (
        f"Fix the mask constant in {f['module']}: fill with torch.finfo(scores.dtype).min "
        "(scores.masked_fill(~keep, torch.finfo(scores.dtype).min)) instead of a constant such as -1e9 that FP16 cannot "
        "hold (added, it becomes -inf; filled, PyTorch refuses the cast); and give a query with no key to attend to (a "
        "sequence that is all padding) one key, or zero its output (torch.where(empty_row, 0, out)) where the filled "
        "row is finite."),
}


def _fill_beyond(f: Facts) -> str:
    return (f"In the {f['stage']} stage the {f['op']} op inside {f['module']} writes a value of magnitude "
            f"{gen(f['fp32_absmax'])} (its FP32 output) into an FP16 tensor at step {f['step']}, beyond FP16's max 65504: "
            f"PyTorch refuses the cast ({f['message'][:80]}). A constant FP16 cannot hold, such as a -1e9 mask, "
            "overflows the forward pass.")


SUMMARIES: dict[str, Callable[[Facts], str]] = {"fill_beyond": _fill_beyond}
"""Verdict variants of ``judge.refine`` → the verdict's summary."""

TITLES: dict[str, Callable[[Facts], str]] = {
    "fill_beyond": lambda f: f"{f['module']}'s {f['op']} writes a value FP16 cannot hold",
}
"""Verdict variants of ``judge.refine`` → the title of the deciding finding."""


def _ev_grad_node(ev: Facts) -> str | None:
    if not ev.get("grad_node"):
        return None
    op = f"{ev['grad_op']}" + (f" at {ev['grad_line']}" if ev.get("grad_line") else "") if ev.get("grad_op") else "no recorded op"
    how = "receives a non-finite sum of finite gradients" if ev.get("grad_summed") else "makes the first non-finite gradient"
    return f"In backward, {ev['grad_node']} ({op}, in {_where({'module': ev.get('grad_module')})}) {how}."


def _ev_rows(ev: Facts) -> str | None:
    m, beyond = ev.get("fully_masked_rows"), ev.get("rows_beyond_fp16")
    r = m or beyond
    if not r:
        return None
    what = "masked throughout" if m else "beyond FP16's range throughout"
    return f"Rows of its {r['op']} {what}: {r['rows']}, first at index {tuple(r['first'])}{samples(r)}."


EVIDENCE: tuple[tuple[Callable[[Facts], str | None], tuple[str, ...]], ...] = (
    (_ev_grad_node, ("grad_node", "grad_op", "grad_line", "grad_module", "grad_summed")),
    (_ev_rows, ("fully_masked_rows", "rows_beyond_fp16")),
)
"""Evidence of ``judge.refine`` → a sentence, with the keys it tells."""
