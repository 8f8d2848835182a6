"""The checks of attention mask constants (``lint.rules``: AMP006 a constant beyond FP16's range, AMP007 one too
weak to mask, AMP008 ``torch.finfo(torch.float16).min`` added to scores), one function per rule, each yielding
(node, message)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampdoctor.lint.check_context import FP16_MAX, Ctx, Hit
from ampdoctor.lint.syntax import arg, call_name, dotted, fp16_dtype, last, method, names_in, number


# --- AMP006 / AMP007 / AMP008: mask constants ------------------------------------------------------------------------
def _mask_uses(ctx: Ctx) -> Iterator[tuple[ast.AST, float, str]]:
    """(node, signed value as the mask applies it, how) for numeric constants used as masks."""
    for c in ctx.f.calls:
        name = last(call_name(c)) or (method(c) or (None, ""))[1]
        if name in ("masked_fill", "masked_fill_"):
            mc = method(c)
            v = arg(c, 1, "value") if mc is not None and dotted(mc[0]) != "torch" else arg(c, 2, "value")
            x = number(v)
            if x is not None:
                yield v, x, "masked_fill"  # type: ignore[misc]
        elif name == "where" and len(c.args) == 3 and not ctx.f.canon(call_name(c)).startswith(("numpy.", "np.")):
            if all(number(a) is not None for a in c.args[1:]):
                continue  # where(cond, 0.0, -1e10): a new FP32 tensor (the default dtype), not the scores
            for a in c.args[1:]:
                x = number(a)
                if x is not None:
                    yield a, x, "where"
    for n in ctx.f.nodes:
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)):
            for side in (n.left, n.right):
                sign = -1.0 if (side is n.right and isinstance(n.op, ast.Sub)) else 1.0
                for val, node in _mult_constants(side):
                    yield node, sign * val, "added"
        elif isinstance(n, ast.AugAssign) and isinstance(n.op, (ast.Add, ast.Sub)):
            sign = -1.0 if isinstance(n.op, ast.Sub) else 1.0
            for val, node in _mult_constants(n.value):
                yield node, sign * val, "added"
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Mult):
            for val, node in _mult_constants(n.value):
                if val < 0:
                    yield node, val, "added"  # mask = (1 - m) * -10000.0, added to the scores later


def _dtype_guarded(ctx: Ctx, node: ast.AST) -> bool:
    """The constant sits in a branch chosen by dtype (``if x.dtype == torch.float16: ... else: -1e30``):
    the code handles FP16 itself."""
    n: ast.AST | None = node
    while n is not None:
        p = ctx.f.parent.get(n)
        if isinstance(p, (ast.If, ast.IfExp)) and n is not p.test:
            test = names_in(p.test)
            if any(x.endswith((".dtype", "float16", "half", "bfloat16", "float32")) or x == "dtype" for x in test):
                return True
        if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)):
            return False
        n = p
    return False


def _mult_constants(node: ast.AST) -> Iterator[tuple[float, ast.AST]]:
    """A constant factor of a product: ``mask * -1e9``, ``(1 - m) * -1e4``. A bare constant added
    (``state -= 1e38``, an initial running max) is no mask and is left alone."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        for side in (node.left, node.right):
            y = number(side)
            if y is not None and not isinstance(side, ast.BinOp):
                other = node.right if side is node.left else node.left
                if number(other) is None:  # 2 * 1e4 is arithmetic, not a mask
                    yield y, side


def mask_overflows(ctx: Ctx) -> Iterator[Hit]:
    if not ctx.f.fp16_possible():
        return
    seen: set[int] = set()
    for node, v, how in _mask_uses(ctx):
        if abs(v) > FP16_MAX and v != float("-inf") and v != float("inf") and id(node) not in seen and (v < 0 or how == "masked_fill") \
                and not _dtype_guarded(ctx, node):
            seen.add(id(node))
            yield node, f"mask value {_fmt(v)} is outside FP16's range (max 65504)"


def mask_too_weak(ctx: Ctx) -> Iterator[Hit]:
    if not ctx.f.reduced_precision():
        return
    seen: set[int] = set()
    for node, v, _how in _mask_uses(ctx):
        if -65000.0 < v <= -1e4 and id(node) not in seen and not _dtype_guarded(ctx, node):
            seen.add(id(node))
            yield node, f"mask value {_fmt(v)} may not mask scores below it"


def _fmt(v: float) -> str:
    return f"{v:g}"


def _is_finfo_fp16_min(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "min" and isinstance(node.value, ast.Call):
        c = node.value
        if last(call_name(c)) == "finfo" and c.args and fp16_dtype(c.args[0]) == "fp16":
            return True
    x = number(node)
    return x is not None and -65504.0 <= x <= -65000.0


SAFE_MASK_CALLS = {"masked_fill", "masked_fill_", "where", "clamp", "clamp_", "clamp_min", "max", "maximum", "fill_"}


def finfo_min_added(ctx: Ctx) -> Iterator[Hit]:
    for n in ctx.f.nodes:
        if not _is_finfo_fp16_min(n):
            continue
        p: ast.AST | None = ctx.f.parent.get(n)
        child: ast.AST = n
        fire = False
        while p is not None:
            if isinstance(p, ast.Call):
                name = last(call_name(p)) or (method(p) or (None, ""))[1]
                if name in SAFE_MASK_CALLS:
                    break
            if isinstance(p, ast.BinOp) and isinstance(p.op, (ast.Add, ast.Sub)):
                fire = True
                break
            if isinstance(p, ast.AugAssign) and isinstance(p.op, (ast.Add, ast.Sub)) and child is p.value:
                fire = True
                break
            if isinstance(p, ast.Assign):
                fire = any(_added_later(ctx, t, p) for t in p.targets)
                break
            if isinstance(p, (ast.stmt, ast.Lambda)):
                break
            child, p = p, ctx.f.parent.get(p)
        if fire:
            yield n, "finfo(float16).min added to scores: overflows to -inf"


def _added_later(ctx: Ctx, target: ast.AST, assign: ast.Assign, hops: int = 2) -> bool:
    """``mask = ... finfo.min ...`` and later ``scores + mask`` in the same scope (or ``scores + m`` where
    ``m = torch.triu(mask)``: two assignments followed)."""
    name = dotted(target)
    if name is None:
        return False
    scope = ctx.f.scope_of(assign)
    for n in ast.walk(scope.node):
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)) and name in (dotted(n.left), dotted(n.right)):
            return True
        if isinstance(n, ast.AugAssign) and isinstance(n.op, (ast.Add, ast.Sub)) and dotted(n.value) == name:
            return True
    if hops > 0:
        for n in ast.walk(scope.node):
            if isinstance(n, ast.Assign) and n is not assign and name in names_in(n.value) and not _safe_use(n.value, name):
                if any(_added_later(ctx, t, n, hops - 1) for t in n.targets):
                    return True
    return False


def _safe_use(value: ast.AST, name: str) -> bool:
    """The name goes into masked_fill/where/clamp: filled, not added."""
    for n in ast.walk(value):
        if isinstance(n, ast.Call) and (last(call_name(n)) or (method(n) or (None, ""))[1]) in SAFE_MASK_CALLS \
                and any(name in names_in(a) for a in n.args[1:]):
            return True
    return False
