"""The checks of precision and numerics (``lint.rules``: AMP005 Adam on FP16 parameters, AMP009 a hand-written
softmax, AMP010 the log of a softmax, AMP011 an epsilon FP16 rounds to 0, AMP012 variance in FP16, AMP014
autocast for another device than the model's), one function per rule, each yielding (node, message)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampdoctor.lint.check_context import FP16_TINY, Ctx, Hit
from ampdoctor.lint.flow import Func
from ampdoctor.lint.syntax import (
    EPS_OPTIMIZERS,
    arg,
    call_name,
    casts_to_float,
    device_literal,
    dotted,
    fp16_dtype,
    last,
    method,
    number,
    root_of,
)


# --- AMP005 -----------------------------------------------------------------------------------------------------------
def _halves(node: ast.AST) -> str | None:
    """The name an expression makes FP16: ``model.half()``, ``model.to(torch.float16)``, ``Net().half()``."""
    m = method(node)
    if not m:
        return None
    recv, meth = m
    is_half = meth == "half" or (meth in ("to", "type") and any(fp16_dtype(a) == "fp16" for a in [
        *node.args, *(k.value for k in node.keywords if k.arg == "dtype")]))  # type: ignore[attr-defined]
    if is_half:
        return dotted(recv) or "<expr>"
    return _halves(recv) if isinstance(recv, ast.Call) else None


def adam_on_half(ctx: Ctx) -> Iterator[Hit]:
    for fn in [ctx.f.module, *ctx.f.funcs]:
        half: set[str] = set()
        params: dict[str, str] = {}
        body = _scope_stmts(fn)
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                v = stmt.value
                targets = [d for d in (dotted(t) for t in stmt.targets) if d]
                h = _halves(v)
                if h is not None:
                    half.update(targets)
                    if h != "<expr>":
                        half.add(h)
                    continue
                r = root_of(v)
                if r is not None and not isinstance(v, ast.Call) or (isinstance(v, ast.Call) and last(call_name(v)) in
                                                                      ("list", "filter", "tuple")):
                    for t in targets:
                        if r:
                            params[t] = r
                m = method(v)
                if m and m[1] == "float":
                    half.difference_update(targets)
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                h = _halves(stmt.value)
                if h is not None and h != "<expr>":
                    half.add(h)
                m = method(stmt.value)
                if m and m[1] == "float" and dotted(m[0]):
                    half.discard(dotted(m[0]))  # type: ignore[arg-type]
            for c in (n for n in _own_nodes(stmt) if isinstance(n, ast.Call)):
                cname = last(call_name(c))
                if cname not in EPS_OPTIMIZERS:
                    continue
                p = arg(c, 0, "params")
                root = root_of(p) if p is not None else None
                if root is None and isinstance(p, ast.Name):
                    root = params.get(p.id)
                if root is not None and root in half:
                    yield c, f"{cname} on FP16 parameters of {root}: no FP32 master weights"


def _scope_stmts(fn: Func) -> list[ast.stmt]:
    """The statements of a function in source order, into if/for/with/try blocks, not into nested defs."""
    out: list[ast.stmt] = []

    def walk(body: list[ast.stmt]) -> None:
        for s in body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            out.append(s)
            for name in ("body", "orelse", "finalbody"):
                sub = getattr(s, name, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                    walk(sub)
            for h in getattr(s, "handlers", []) or []:
                walk(h.body)

    walk(list(fn.node.body))
    return out


def _own_nodes(stmt: ast.stmt) -> Iterator[ast.AST]:
    """The nodes of a statement, without the statements nested in its blocks."""
    todo: list[ast.AST] = [stmt]
    while todo:
        n = todo.pop()
        yield n
        for name, value in ast.iter_fields(n):
            if name in ("body", "orelse", "finalbody", "handlers") and n is stmt:
                continue
            if isinstance(value, list):
                todo.extend(v for v in value if isinstance(v, ast.AST) and not isinstance(v, (ast.FunctionDef, ast.Lambda)))
            elif isinstance(value, ast.AST) and not isinstance(value, ast.Lambda):
                todo.append(value)


# --- AMP009 / AMP010 / AMP011 / AMP012: numerics ---------------------------------------------------------------------
def _exp_arg(node: ast.AST) -> ast.AST | None:
    """The x of ``torch.exp(x)`` / ``x.exp()``."""
    if isinstance(node, ast.Call):
        if last(call_name(node)) == "exp" and call_name(node) in ("torch.exp", "exp", "math.exp") and node.args:
            return node.args[0]
        m = method(node)
        if m and m[1] == "exp" and not node.args:
            return m[0]
    return None


def _stable(x: ast.AST) -> bool:
    """``x - x.max()``-like: the exponent is shifted by a maximum, or computed in FP32."""
    for n in ast.walk(x):
        if isinstance(n, ast.Call) and (last(call_name(n)) in ("max", "amax", "logsumexp") or
                                        (method(n) or (None, ""))[1] in ("max", "amax", "logsumexp")):
            return True
    return casts_to_float(x)


def hand_softmax(ctx: Ctx) -> Iterator[Hit]:
    if not ctx.f.fp16_possible():
        return
    for n in ctx.f.nodes:
        if not (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)):
            continue
        num_x = _exp_arg(n.left)
        num_name = dotted(n.left) if isinstance(n.left, ast.Name) else None
        if num_x is None and num_name is not None:
            for v in ctx.f.assigned(num_name, ctx.f.scope_of(n)):
                num_x = _exp_arg(v) or num_x
        if num_x is None or _stable(num_x):
            continue
        key = ast.dump(num_x)
        for d in ast.walk(n.right):
            m = method(d) if isinstance(d, ast.Call) else None
            summed = None
            if m and m[1] == "sum":
                summed = m[0]
            elif isinstance(d, ast.Call) and call_name(d) == "torch.sum" and d.args:
                summed = d.args[0]
            if summed is None:
                continue
            sx = _exp_arg(summed)
            if (sx is not None and ast.dump(sx) == key) or (num_name is not None and dotted(summed) == num_name):
                yield n, "hand-written softmax: exp() overflows FP16 above 11.1"
                break


def _softmax_like(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    name = last(call_name(node)) or (method(node) or (None, ""))[1]
    return name if name in ("softmax", "sigmoid") else None


def log_of_softmax(ctx: Ctx) -> Iterator[Hit]:
    if not ctx.f.fp16_possible():
        return
    for c in ctx.f.calls:
        x = _log_arg(c)
        if x is None:
            continue
        inner = x
        if isinstance(x, ast.BinOp) and isinstance(x.op, ast.Add):  # log(softmax(x) + 1e-8)
            eps = number(x.right) if number(x.right) is not None else number(x.left)
            if eps is not None and eps >= FP16_TINY:
                continue
            inner = x.left if number(x.right) is not None else x.right
        if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Sub) and number(inner.left) == 1.0:
            inner = inner.right  # log(1 - sigmoid(x)): the same underflow on the other side
        kind = _softmax_like(_value_of(ctx, inner, c))  # p = torch.sigmoid(logits); torch.log(p)
        if kind is not None:
            yield c, f"log of {kind}: -inf where a probability underflows"


def _value_of(ctx: Ctx, node: ast.AST, at: ast.AST) -> ast.AST:
    """A name's one value in the scope (``p`` of ``p = torch.sigmoid(x)``), else the node itself."""
    if isinstance(node, ast.Name):
        vals = ctx.f.assigned(node.id, ctx.f.scope_of(at))
        if len(vals) == 1:
            return vals[0]
    return node


def _log_arg(c: ast.Call) -> ast.AST | None:
    name = call_name(c)
    if name in ("torch.log", "log") and c.args:
        return c.args[0]
    m = method(c)
    if m and m[1] == "log" and not c.args and dotted(m[0]) not in ("math", "np", "numpy", "torch"):
        return m[0]
    return None


ROOTS = {"log", "sqrt", "rsqrt", "log2", "log10"}


def tiny_eps(ctx: Ctx) -> Iterator[Hit]:
    for n in ctx.f.nodes:
        target: ast.AST | None = None
        what = ""
        if isinstance(n, ast.Call):
            name = last(call_name(n)) if (call_name(n) or "").startswith("torch.") else (method(n) or (None, ""))[1]
            if name in ROOTS:
                target = n.args[0] if (call_name(n) or "").startswith("torch.") and n.args else (method(n) or (None, None))[0]
                what = name
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            target, what = n.right, "division"
        if target is None or not isinstance(target, ast.BinOp) or not isinstance(target.op, ast.Add):
            continue
        eps = number(target.right) if number(target.right) is not None else number(target.left)
        if eps is None or not (0 < eps < FP16_TINY) or _in_fp32(ctx, target, n):
            continue
        if what == "log" and _softmax_like(_value_of(ctx, target.left if number(target.right) is not None else target.right, n)):
            continue  # AMP010 says it
        r = ctx.f.region(n)
        if r is None or not r.fp16:
            continue
        yield target, f"eps {eps:g} is 0 in FP16: {what} can still see 0"


VARIANCE = {"var", "std", "var_mean", "std_mean"}


def _in_fp32(ctx: Ctx, x: ast.AST, at: ast.AST) -> bool:
    """The expression is computed in FP32: it casts (``x.float()``), or the names it is made of were
    assigned from a cast in the same scope (``h = model(x).float()``)."""
    if casts_to_float(x):
        return True
    scope = ctx.f.scope_of(at)
    names = [n.id for n in ast.walk(x) if isinstance(n, ast.Name)]
    for name in names:
        vals = ctx.f.assigned(name, scope)
        if vals and all(casts_to_float(v) for v in vals):
            return True
    return False


def variance_in_autocast(ctx: Ctx) -> Iterator[Hit]:
    for c in ctx.f.calls:
        name = call_name(c) or ""
        m = method(c)
        x: ast.AST | None = None
        if name in {f"torch.{v}" for v in VARIANCE} and c.args:
            x, fn = c.args[0], last(name)
        elif m and m[1] in VARIANCE and dotted(m[0]) not in ("torch", "np", "numpy", "statistics"):
            x, fn = m[0], m[1]
        if x is None or _in_fp32(ctx, x, c):
            continue
        r = ctx.f.region(c)
        if r is None or not r.fp16:
            continue
        yield c, f"{fn}() under FP16 autocast: squares overflow past 256"


# --- AMP014 -----------------------------------------------------------------------------------------------------------
def autocast_device(ctx: Ctx) -> Iterator[Hit]:
    models = _model_names(ctx)
    if not models:
        return
    devices: set[str | None] = set()
    for c in ctx.f.calls:
        m = method(c)
        if not m or dotted(m[0]) not in models:
            continue
        if m[1] == "cuda":
            devices.add("cuda")
        elif m[1] == "to" and c.args:
            devices.add(_device_of(ctx, c.args[0], ctx.f.scope_of(c)))
    for n in ctx.f.nodes:  # model = Net().to("cuda") / Net().cuda()
        if isinstance(n, ast.Assign) and any(dotted(t) in models for t in n.targets):
            v = n.value
            while (m := method(v)) is not None and m[1] in ("to", "cuda", "half", "float", "train"):
                if m[1] == "cuda":
                    devices.add("cuda")
                elif m[1] == "to" and v.args:  # type: ignore[attr-defined]
                    devices.add(_device_of(ctx, v.args[0], ctx.f.scope_of(n)))  # type: ignore[attr-defined]
                v = m[0]
    devices.discard("fp")  # .to(torch.float16): a dtype, not a device
    if len(devices) != 1 or None in devices:
        return
    where = devices.pop()
    for node, r in ctx.f.regions.items():
        if isinstance(node, (ast.With, ast.AsyncWith)) and r.device is not None and r.device != where and \
                isinstance(r.node, ast.Call) and call_name(r.node) is not None:
            yield r.node, f"autocast for {r.device!r} but the model is on {where!r}: no autocast"


def _model_names(ctx: Ctx) -> set[str]:
    """Names whose parameters an optimizer takes (``opt = Adam(model.parameters())``)."""
    out: set[str] = set()
    for ctor in ctx.f.optimizers.values():
        if ctor is not None:
            r = root_of(arg(ctor, 0, "params"))
            if r:
                out.add(r)
    return out


def _device_of(ctx: Ctx, node: ast.AST, scope: Func) -> str | None:
    lit = device_literal(node)
    if lit is not None:
        return lit
    if fp16_dtype(node) is not None:
        return "fp"
    if isinstance(node, ast.Name):
        vals = ctx.f.assigned(node.id, scope)
        kinds = {device_literal(v) for v in vals}
        if len(kinds) == 1:
            return kinds.pop()
    return None
