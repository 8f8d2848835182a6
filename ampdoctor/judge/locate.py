"""Find the first offending module in one step's statistics. Pure functions over StepStats.

Rules (from the issue that defines the product):
- forward: the innermost module whose inputs are all finite and whose output is not, first in
  execution order;
- backward: the first module reached in backward whose incoming gradient (at its outputs) is
  finite and whose outgoing gradient (at its inputs) or own parameter gradients are not; a
  gradient already non-finite where it enters the model names the module producing the output;
- underflow: the first module in backward order whose own parameter gradients are more than half
  flushed to zero while non-zero in FP32.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ampdoctor.records import LABELS, MODEL, Call, Col, StepStats, nonfinite


def is_ancestor(a: str, b: str) -> bool:
    """True when module a strictly contains module b."""
    return a != b and (a == MODEL or b.startswith(a + "."))


def innermost(names: Iterable[str]) -> list[str]:
    """Drop every name that is an ancestor of another name in the list; keep order."""
    ns = list(dict.fromkeys(names))
    return [a for a in ns if not any(is_ancestor(a, b) for b in ns)]


def _bad(rows: dict[int, np.ndarray], tids: Sequence[int]) -> bool:
    return any(t in rows and nonfinite(rows[t]) > 0 for t in tids)


def forward_fault(st: StepStats) -> bool:
    """Any module output non-finite in this step's forward."""
    return any(_bad(st.act, c.outputs) for c in st.calls)


def locate_forward(st: StepStats) -> str | None:
    """Innermost module with all-finite inputs and a non-finite output (None if none)."""
    cands = [c.module for c in st.calls if not _bad(st.act, c.inputs) and _bad(st.act, c.outputs)]
    inner = innermost(cands)
    return inner[0] if inner else None


def first_consumer_of_inputs(st: StepStats) -> str | None:
    """The first leaf module (in execution order) that reads one of the model's inputs."""
    inputs = set(st.model_inputs)
    leaves = innermost(c.module for c in st.calls if inputs & set(c.inputs))
    return leaves[0] if leaves else None


def first_consumer_of(st: StepStats, tid: int) -> str | None:
    """The first leaf module (in execution order) that reads the model input ``tid``; ``LABELS`` when no module
    but the model's own code reads it (labels read only by its loss); None when nothing does."""
    leaves = innermost(c.module for c in st.calls if tid in c.inputs)
    if leaves == [MODEL]:
        return LABELS
    return next((m for m in leaves if m != MODEL), None)


def first_reader_of_derived(st: StepStats) -> str | None:
    """The first leaf module (not the root) that reads a tensor no module made: where the model's input
    enters when the root's own code, or an engine's hook on it, copied it first (FSDP casts the inputs to
    its ``param_dtype`` before the root's forward)."""
    made = {t for c in st.calls for t in c.outputs}
    leaves = innermost(c.module for c in st.calls if c.module != MODEL and any(t not in made for t in c.inputs))
    return leaves[0] if leaves else None


def producer(st: StepStats, tid: int) -> str | None:
    """Innermost module that returned tensor ``tid``."""
    names = innermost(c.module for c in st.calls if tid in c.outputs)
    return names[0] if names else None


def own_params(module: str, names: Iterable[str]) -> list[str]:
    """Parameter names owned directly by ``module`` (not by its children)."""
    prefix = "" if module == MODEL else module + "."
    return [n for n in names if n.startswith(prefix) and "." not in n[len(prefix):]]


def backward_fault(st: StepStats) -> bool:
    return any(nonfinite(r) > 0 for r in st.grad.values()) or any(nonfinite(r) > 0 for r in st.pgrad.values())


def locate_backward(st: StepStats, ref: StepStats | None = None) -> str | None:
    """First module reached in backward with finite incoming and non-finite outgoing/param grads. ``ref``: the FP32
    reference's statistics of the same step, which tell which part of a join carries the inf (``entry_child``)."""
    for tid in st.model_outputs:
        if tid in st.grad and nonfinite(st.grad[tid]) > 0:
            p = producer(st, tid)
            return entry_child(st, ref, within=p or MODEL) or p
    order = {tid: i for i, tid in reversed(list(enumerate(st.grad_order)))}
    entered = [c for c in st.calls if _bad(st.grad, [t for t in c.outputs if t in st.grad])]
    cands: list[tuple[int, str]] = []
    for c in st.calls:
        incoming = [t for t in c.outputs if t in st.grad]
        if not incoming or _bad(st.grad, incoming):
            continue
        pbad = any(nonfinite(st.pgrad[p]) > 0 for p in own_params(c.module, st.pgrad))
        # a gradient at an input accumulates over every consumer of that tensor: one non-finite because another
        # consumer (not nested with this one) already received a non-finite gradient is not this module's
        made = [t for t in c.inputs if t in st.grad and nonfinite(st.grad[t]) > 0 and not any(
            t in o.inputs and o.module != c.module and not is_ancestor(o.module, c.module)
            and not is_ancestor(c.module, o.module) for o in entered)]
        if made or pbad:
            cands.append((min(order.get(t, 1 << 30) for t in incoming), c.module))
    cands.sort()
    inner = innermost(n for _, n in cands)
    if inner:
        return inner[0]
    # none made it: the root's own code did (a weighted sum, a cat of heads); name where it entered a child
    return entry_child(st, ref) if any(c.module != MODEL for c in entered) else None


def entry_child(st: StepStats, ref: StepStats | None = None, within: str = MODEL) -> str | None:
    """Where a non-finite gradient made by the own code of ``within`` (the root, or the module returning the model's
    output: a cat or stack of heads, a softplus) enters one of its descendants.

    The candidates are the innermost descendants whose output receives a non-finite gradient, less those whose output
    another candidate (not nested with it) reads: a trunk's gradient is the sum over the heads reading it, non-finite
    because one of theirs is. The rest are the parts of the join. When several carry an inf (at GradScaler's scale
    every part may), the part that carries it is the one whose gradient is largest in ``ref`` (FP32, same step): the
    scale multiplies every part alike, so the largest overflows first, at the lowest scale, and stays non-finite when
    the others fit. Without ``ref``, the first reached in backward."""
    order = {tid: i for i, tid in reversed(list(enumerate(st.grad_order)))}
    bad = [c for c in st.calls if c.module != MODEL and c.module != within and (within == MODEL or is_ancestor(within, c.module))
           and _bad(st.grad, [t for t in c.outputs if t in st.grad])]
    src = [c for c in bad if not any(t in o.inputs for o in bad if o.module != c.module and not is_ancestor(o.module, c.module)
                                     and not is_ancestor(c.module, o.module) for t in c.outputs)]
    cands = sorted((min(order.get(t, 1 << 30) for t in c.outputs if t in st.grad), c.module) for c in src)
    inner = innermost(n for _, n in cands)
    if len(inner) > 1 and ref is not None:
        part = {m: _ref_grad_absmax(st, ref, m) for m in inner}
        if all(v is not None for v in part.values()):
            return max(inner, key=lambda m: (part[m], -inner.index(m)))
    return inner[0] if inner else None


def _ref_grad_absmax(st: StepStats, ref: StepStats, module: str) -> float | None:
    """The largest |gradient| at ``module``'s outputs in ``ref`` (the same step of another stage), matched by the
    module's call and output position (both stages run the same forward); inf when non-finite there too."""
    mine = [c for c in st.calls if c.module == module]
    theirs = [c for c in ref.calls if c.module == module]
    if not mine or len(mine) != len(theirs):
        return None
    best = None
    for a, b in zip(mine, theirs, strict=True):
        for ta, tb in zip(a.outputs, b.outputs, strict=False):
            if ta in st.grad and tb in ref.grad:
                row = ref.grad[tb]
                v = float("inf") if nonfinite(row) > 0 else float(row[Col.ABSMAX])
                best = v if best is None else max(best, v)
    return best


def module_of_param(param: str, modules: Iterable[str]) -> str:
    """The module that owns a parameter name like 'encoder.0.weight'."""
    head = param.rsplit(".", 1)[0] if "." in param else MODEL
    return head if head in set(modules) or head == MODEL else head


def zero_frac(row: np.ndarray) -> float:
    """Share of elements that are zero or become zero in FP16."""
    n = row[Col.NUMEL]
    return float((row[Col.ZERO] + row[Col.UNDERFLOW]) / n) if n else 0.0


def flushed_frac(target: np.ndarray, ref: np.ndarray) -> float:
    """Share of the FP32-non-zero gradient elements that are zero in the target stage."""
    zr = zero_frac_exact(ref)
    zt = zero_frac_exact(target)
    if zr >= 1.0:
        return 0.0
    return max(0.0, (zt - zr) / (1.0 - zr))


def zero_frac_exact(row: np.ndarray) -> float:
    n = row[Col.NUMEL]
    return float(row[Col.ZERO] / n) if n else 0.0


def backward_order(st: StepStats) -> list[str]:
    """Module names in the order backward reached them (first gradient at one of their outputs)."""
    first: dict[str, int] = {}
    pos = {tid: i for i, tid in reversed(list(enumerate(st.grad_order)))}
    for c in st.calls:
        ps = [pos[t] for t in c.outputs if t in pos]
        if ps:
            first[c.module] = min(min(ps), first.get(c.module, 1 << 30))
    return sorted(first, key=first.__getitem__)


__all__ = ["Call", "locate_forward", "locate_backward", "forward_fault", "backward_fault", "innermost"]
