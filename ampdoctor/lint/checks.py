"""The checks behind the rules: one function per rule, over one file's facts, yielding (node, message).

A check yields only what it can decide from the text. Where a name cannot be followed (a scaler
passed in from another file, a dtype chosen at run time) it yields nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from functools import cached_property

from ampdoctor.lint.events import Event, Events, exclusive, reachable
from ampdoctor.lint.flow import FileFacts, Func
from ampdoctor.lint.syntax import (
    CLIP_FUNCS,
    EPS_OPTIMIZERS,
    arg,
    call_name,
    casts_to_float,
    device_literal,
    dotted,
    fp16_dtype,
    last,
    method,
    names_in,
    number,
    root_of,
)

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24
"""FP16's smallest subnormal (5.96e-8): a smaller constant rounds to 0."""

Hit = tuple[ast.AST, str]


class Ctx:
    """One file's facts and, computed once, the events of each of its functions."""

    def __init__(self, facts: FileFacts) -> None:
        self.f = facts

    @cached_property
    def events(self) -> list[Events]:
        maybe = self.f.may_step()  # (a function that cannot reach a step has no event any rule reads)
        return [Events(self.f, fn) for fn in [self.f.module, *self.f.funcs] if id(fn) in maybe]

    def scope_events(self) -> Iterator[list[Event]]:
        for ev in self.events:
            if ev.items:
                yield ev.items


def _short(node: ast.AST | None, default: str = "...") -> str:
    if node is None:
        return default
    try:
        text = ast.unparse(node)
    except Exception:  # pragma: no cover - unparse handles every node the parser makes
        return default
    return text if len(text) <= 28 else default


def _same_iteration(a: Event, loops: tuple[int, ...]) -> bool:
    return a.loops[: len(loops)] == loops


def _name_or(x: str | None, default: str) -> str:
    return x if x else default


# --- AMP001 -----------------------------------------------------------------------------------------------------------


def clip_before_unscale(ctx: Ctx) -> Iterator[Hit]:
    for items in ctx.scope_events():
        for c in (e for e in items if e.kind == "clip"):
            steps = [s for s in items if s.kind == "step" and s.order > c.order and c.loops[: len(s.loops)] == s.loops
                     and not exclusive(c, s) and reachable(items, c, s)]
            if not steps:
                continue
            s = next((x for x in steps if _params_of(ctx, c, x.optimizer)), steps[0])  # the clipped parameters' optimizer
            window = [e for e in items if e.order < c.order and _same_iteration(e, s.loops) and not exclusive(e, c)
                      and e.scaler is not None and _same(e.scaler, s.scaler)]
            last_update = max((e.order for e in window if e.kind == "update"), default=0)
            unscales = [e for e in window if e.kind == "unscale" and e.order > last_update]
            if unscales:
                opts = {u.optimizer for u in unscales}
                if s.optimizer in opts or None in opts or not _params_of(ctx, c, s.optimizer):
                    continue  # unscaled already (or for an optimizer whose parameters we cannot tell apart)
            fn = last(call_name(c.node)) or "clip_grad_norm_"  # type: ignore[arg-type]
            yield c.node, f"{fn} before {_name_or(s.scaler, 'scaler')}.unscale_({_name_or(s.optimizer, 'optimizer')})"


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and (a == b or last(a) == last(b))


def _params_of(ctx: Ctx, clip: Event, optimizer: str | None) -> bool:
    """The clipped parameters are decidably the optimizer's: both come from the same model."""
    if optimizer is None:
        return False
    ctor = ctx.f.optimizers.get(optimizer)
    if ctor is None:
        return False
    opt_root = root_of(arg(ctor, 0, "params"))
    clip_root = root_of(clip.params)
    return opt_root is not None and opt_root == clip_root


# --- AMP002 -----------------------------------------------------------------------------------------------------------


def update_skipped(ctx: Ctx) -> Iterator[Hit]:
    updated = {last(dotted(m[0])) for c in ctx.f.calls if (m := method(c)) and m[1] == "update" and dotted(m[0])}
    for items in ctx.scope_events():
        for s in (e for e in items if e.kind == "step"):
            sc = _name_or(s.scaler, "scaler")
            if last(s.scaler) not in updated:
                yield s.node, f"{sc}.step() with no {sc}.update(): the scale never adapts"
                continue
            ups = [u for u in items if u.kind == "update" and _same(u.scaler, s.scaler) and not exclusive(u, s)
                   and (u.order < s.order or reachable(items, s, u))]
            if not ups:
                continue  # updated elsewhere (a caller, another helper): cannot tell
            inner = s.loops[-1] if s.loops else None
            same_loop = [u for u in ups if inner is None or inner in u.loops]
            if inner is not None and not same_loop:
                after = [u for u in ups if u.order > s.order]
                if after:
                    yield after[0].node, f"{sc}.update() once after the loop, not after every {sc}.step()"
                continue
            u = next((u for u in same_loop if u.order > s.order), None)
            if u is None:
                continue
            extra = [k for k in u.conds if k not in s.conds]
            guard_names = {n for n in u.guard if n not in s.guard}
            if extra and not any(_is_amp_switch(n, s.scaler) for n in guard_names) and len(u.loops) == len(s.loops):
                yield u.node, f"{sc}.update() only on some iterations, not after every {sc}.step()"
                continue
            # a continue/break/return between unscale_/step and update
            before = max((x.order for x in items if x.kind == "update" and _same(x.scaler, s.scaler) and x.order < s.order),
                         default=0)
            starts = [e for e in items if e.kind in ("unscale", "step") and _same(e.scaler, s.scaler)
                      and e.loops == s.loops and before < e.order < u.order]
            if not starts:
                continue
            first = min(e.order for e in starts)
            for j in items:
                if j.kind != "jump" or not (first < j.order < u.order) or not j.loops[: len(s.loops)] == s.loops:
                    continue
                if j.jump_loop not in (-1, inner) or any(exclusive(j, e) for e in starts if e.order < j.order) is True \
                        and all(exclusive(j, e) for e in starts if e.order < j.order):
                    continue
                covered = any(x.kind == "update" and _same(x.scaler, s.scaler) and x.order < j.order
                              and x.conds == j.conds[: len(x.conds)] and x.order > first for x in items)
                if covered:
                    continue
                word = type(j.node).__name__.lower()
                yield j.node, (f"{word} skips {sc}.update() after {sc}."
                               f"{'unscale_' if any(e.kind == 'unscale' and e.order < j.order for e in starts) else 'step'}()")
                break


def _is_amp_switch(name: str, scaler: str | None) -> bool:
    low = name.lower()
    return (scaler is not None and (name == scaler or last(name) == last(scaler))) or any(
        w in low for w in ("amp", "fp16", "scaler", "half", "mixed", "precision", "dtype"))


# --- AMP003 / AMP004: gradient hooks ---------------------------------------------------------------------------------

HOOK_METHODS = {"register_hook", "register_full_backward_hook", "register_backward_hook",
                "register_full_backward_pre_hook", "register_post_accumulate_grad_hook"}
CLAMPS = {"clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_max", "clamp_min_", "clamp_max_"}


def _hook_bodies(ctx: Ctx) -> Iterator[tuple[ast.Call, ast.AST]]:
    """(register call, the hook's lambda or def) for every hook whose function this file defines."""
    for c in ctx.f.calls:
        m = method(c)
        if not m or m[1] not in HOOK_METHODS or not c.args:
            continue
        fn: ast.AST | None = c.args[0]
        if isinstance(fn, ast.Call) and last(call_name(fn)) == "partial" and fn.args:
            fn = fn.args[0]
        if isinstance(fn, (ast.Name, ast.Attribute)):
            want = last(dotted(fn))
            scope = ctx.f.scope_of(c)
            target = ctx.f.resolve(ast.Call(func=fn, args=[], keywords=[]), scope) if isinstance(fn, ast.Name) else None
            if target is None:
                target = next((f for f in ctx.f.funcs if f.node.name == want), None)  # type: ignore[union-attr]
            fn = target.node if target is not None else None
        if isinstance(fn, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield c, fn


def _hook_calls(fn: ast.AST) -> Iterator[ast.Call]:
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            yield n


def hook_clamps(ctx: Ctx) -> Iterator[Hit]:
    if not ctx.f.has_scaler():
        return
    for _reg, fn in _hook_bodies(ctx):
        for n in _hook_calls(fn):
            name = last(call_name(n)) or (method(n) or (None, ""))[1]
            if name in CLAMPS or name in CLIP_FUNCS:
                yield n, f"gradient hook calls {name}() on scaled gradients"


def _is_nan_to_num(n: ast.Call) -> bool:
    name = last(call_name(n)) or (method(n) or (None, ""))[1]
    if name in ("nan_to_num", "nan_to_num_"):
        return True
    if name == "where" and n.args and any(last(call_name(x)) in ("isfinite", "isnan", "isinf") or
                                          (method(x) or (None, ""))[1] in ("isfinite", "isnan", "isinf")
                                          for x in ast.walk(n.args[0]) if isinstance(x, ast.Call)):
        return True
    return False


def nan_to_num_grads(ctx: Ctx) -> Iterator[Hit]:
    if not ctx.f.has_scaler():
        return
    seen: set[int] = set()
    for _reg, fn in _hook_bodies(ctx):
        for n in _hook_calls(fn):
            if _is_nan_to_num(n) and id(n) not in seen:
                seen.add(id(n))
                yield n, "gradient hook hides inf/NaN from GradScaler"
    for items in ctx.scope_events():
        for e in (x for x in items if x.kind == "nan_grad"):
            steps = [s for s in items if s.kind == "step" and s.order > e.order and e.loops[: len(s.loops)] == s.loops
                     and not exclusive(e, s) and reachable(items, e, s)]
            if not steps or id(e.node) in seen:
                continue
            s = steps[0]
            unscaled = any(u.kind == "unscale" and _same(u.scaler, s.scaler) and u.order < e.order
                           and _same_iteration(u, s.loops) for u in items)
            if not unscaled:
                seen.add(id(e.node))
                yield e.node, "nan_to_num on .grad before unscale_ hides the inf from GradScaler"


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


# --- AMP013 -----------------------------------------------------------------------------------------------------------


def _state_dicts(d: ast.AST) -> set[str]:
    """Names whose ``.state_dict()`` a checkpoint expression holds."""
    out: set[str] = set()
    for n in ast.walk(d):
        m = method(n)
        if m and m[1] == "state_dict" and dotted(m[0]):
            out.add(dotted(m[0]))  # type: ignore[arg-type]
    return out


def scaler_not_saved(ctx: Ctx) -> Iterator[Hit]:
    if not ctx.f.scalers:
        return
    opts = set(ctx.f.optimizers)
    for c in ctx.f.calls:
        if call_name(c) not in ("torch.save", "save") or not c.args:
            continue
        scope = ctx.f.scope_of(c)
        obj = c.args[0]
        dicts = _checkpoint_dicts(ctx, obj, scope)
        if not dicts or not any(_uses_scaler(ctx, ctx.f.scope_of(d)) for d in dicts):
            continue
        held = set().union(*(_state_dicts(d) for d in dicts))
        held |= _subscript_states(ctx, obj, scope)
        has_opt = any(h in opts or last(h) in {last(o) for o in opts} or "optim" in last(h).lower() for h in held)
        has_scaler = any(ctx.f.is_scaler(h) or "scaler" in last(h).lower() for h in held)
        if has_opt and not has_scaler:
            yield dicts[0], "checkpoint has the optimizer's state, not the scaler's"


def _uses_scaler(ctx: Ctx, scope: Func) -> bool:
    """A GradScaler lives where the checkpoint is made: made at module level or in this function, a
    parameter that holds one, or used as one here (scale, unscale_, step, update)."""
    for w in (ctx.f.tree, scope.node):
        body = w.body if w is ctx.f.tree else [w]
        for stmt in body:
            for n in ast.walk(stmt) if w is not ctx.f.tree else [stmt]:
                if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Call) \
                        and last(call_name(n.value)) in ("GradScaler", "ShardedGradScaler"):
                    return True
    if any(p in ctx.f.scalers for p in scope.params):
        return True
    for n in ast.walk(scope.node):
        m = method(n)
        if m and m[1] in ("scale", "unscale_", "step", "update") and ctx.f.is_scaler(dotted(m[0])):
            return True
    return False


def _checkpoint_dicts(ctx: Ctx, obj: ast.AST, scope: Func) -> list[ast.expr]:
    """The dict literal(s) a ``torch.save`` argument is: itself, a name bound to one, or a helper's
    parameter that the file's callers pass a dict literal to."""
    if isinstance(obj, ast.Dict) or (isinstance(obj, ast.Call) and call_name(obj) == "dict"):
        return [obj]  # type: ignore[list-item]
    if not isinstance(obj, ast.Name):
        return []
    vals: list[ast.expr] = [v for v in ctx.f.assigned(obj.id, scope)
                            if isinstance(v, ast.Dict) or (isinstance(v, ast.Call) and call_name(v) == "dict")]
    if vals:
        return vals[:1]
    if obj.id in scope.params:  # def save_checkpoint(state, ...): torch.save(state, ...)
        i = scope.params.index(obj.id)
        out: list[ast.expr] = []
        for c in ctx.f.calls:
            if ctx.f.resolve(c, ctx.f.scope_of(c)) is scope:
                a = arg(c, i - (1 if scope.cls is not None else 0), obj.id)
                if a is not None and (isinstance(a, ast.Dict) or (isinstance(a, ast.Call) and call_name(a) == "dict")):
                    out.append(a)
        return out[:1]
    return []


def _subscript_states(ctx: Ctx, obj: ast.AST, scope: Func) -> set[str]:
    """``ckpt['scaler'] = scaler.state_dict()`` in the same scope."""
    name = dotted(obj)
    out: set[str] = set()
    if name is None:
        return out
    for n in ast.walk(scope.node):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Subscript) and dotted(t.value) == name:
                    out |= _state_dicts(n.value)
        if isinstance(n, ast.Call) and (method(n) or (None, ""))[1] == "update" and dotted((method(n) or (None,))[0]) == name:
            out |= _state_dicts(n)
    return out


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


# --- AMP015 -----------------------------------------------------------------------------------------------------------


def backward_unscaled(ctx: Ctx) -> Iterator[Hit]:
    for items in ctx.scope_events():
        steps = [e for e in items if e.kind == "step"]
        if not steps or any(e.kind == "scale_backward" for e in items):
            continue
        if any("scale" == (method(c) or (None, ""))[1] and ctx.f.is_scaler(dotted((method(c) or (None,))[0]))
               for e in items for c in ast.walk(e.node) if isinstance(c, ast.Call)):
            continue
        for b in (e for e in items if e.kind == "backward"):
            s = next((s for s in steps if s.order > b.order and b.loops[: len(s.loops)] == s.loops and not exclusive(b, s)
                      and reachable(items, b, s)), None)
            if s is not None:
                sc = _name_or(s.scaler, "scaler")
                yield b.node, f"backward() of the unscaled loss, then {sc}.step()"
                break


CHECKS: dict[str, Callable[[Ctx], Iterator[Hit]]] = {
    "AMP001": clip_before_unscale,
    "AMP002": update_skipped,
    "AMP003": hook_clamps,
    "AMP004": nan_to_num_grads,
    "AMP005": adam_on_half,
    "AMP006": mask_overflows,
    "AMP007": mask_too_weak,
    "AMP008": finfo_min_added,
    "AMP009": hand_softmax,
    "AMP010": log_of_softmax,
    "AMP011": tiny_eps,
    "AMP012": variance_in_autocast,
    "AMP013": scaler_not_saved,
    "AMP014": autocast_device,
    "AMP015": backward_unscaled,
}

__all__ = ["CHECKS", "Ctx", "names_in"]
