"""The checks of GradScaler's recipe (``lint.rules``: AMP001 clip before unscale_, AMP002 update skipped, AMP003 /
AMP004 gradient hooks that clamp or nan_to_num the scaled gradients, AMP013 a checkpoint without the scaler's
state, AMP015 backward without the scale), one function per rule, each yielding (node, message)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampdoctor.lint.check_context import Ctx, Hit
from ampdoctor.lint.events import Event, exclusive, reachable
from ampdoctor.lint.flow import Func
from ampdoctor.lint.syntax import CLIP_FUNCS, arg, call_name, dotted, last, method, root_of


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
