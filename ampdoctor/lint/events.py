"""The training events of a function, in source order (``Events``: backward, step, unscale_, clip, zero_grad,
scaler.update, autocast regions...), with the helpers of the same file inlined, and which events can follow
which (``reachable``, ``exclusive``: an ``if``/``else`` runs one branch)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ampdoctor.lint.flow import FileFacts, Func, bind, walk_scope
from ampdoctor.lint.syntax import CLIP_FUNCS, arg, call_name, dotted, last, method, names_in


@dataclass
class Event:
    """One step of a training loop as the text orders it.

    kind: scale_backward | backward | unscale | clip | step | update | nan_grad | jump | opt_step
    """

    kind: str
    node: ast.AST
    order: int
    loops: tuple[int, ...]
    """ids of the enclosing loops, outermost first"""
    conds: tuple[tuple[int, str], ...]
    """(if-statement id, branch) of the enclosing branches"""
    scaler: str | None = None
    optimizer: str | None = None
    params: ast.expr | None = None
    jump_loop: int | None = None
    """continue/break: the loop it leaves; return: -1"""
    guard: frozenset[str] = frozenset()
    """names mentioned in the tests of the enclosing ifs (a guard like ``if scaler is not None``)"""


def reachable(items: list[Event], a: Event, b: Event) -> bool:
    """``b`` can run after ``a`` in one pass: no continue/break/return on every path from ``a`` lies
    between them (a jump in a block that encloses ``a`` leaves the rest of that iteration)."""
    for j in items:
        if j.kind != "jump" or not (a.order < j.order < b.order):
            continue
        if j.conds != a.conds[: len(j.conds)]:
            continue  # the jump is on a branch of its own: not every path from a takes it
        if j.jump_loop == -1 or (j.jump_loop in a.loops and j.jump_loop in b.loops):
            return False
    return True


def exclusive(a: Event, b: Event) -> bool:
    """Two events on different branches of the same if (or try/except): never both in one pass."""
    ca = dict(a.conds)
    return any(k in ca and ca[k] != br for k, br in b.conds)


class Events:
    """The events of a function body, in source order, with same-file helpers inlined (two calls deep)."""

    def __init__(self, facts: FileFacts, func: Func) -> None:
        self.facts = facts
        self.items: list[Event] = []
        self._order = 0
        self._walk_body(self._body(func), func, (), (), frozenset(), {}, 0, set())

    @staticmethod
    def _body(func: Func) -> list[ast.stmt]:
        return list(func.node.body)

    def _emit(self, kind: str, node: ast.AST, loops: tuple[int, ...], conds: tuple[tuple[int, str], ...],
              guard: frozenset[str], **kw: object) -> None:
        self._order += 1
        self.items.append(Event(kind, node, self._order, loops, conds, guard=guard, **kw))  # type: ignore[arg-type]

    def _walk_body(self, body: list[ast.stmt], scope: Func, loops: tuple[int, ...], conds: tuple[tuple[int, str], ...],
                   guard: frozenset[str], subst: dict[str, str], depth: int, stack: set[int]) -> None:
        for stmt in body:
            self._walk_stmt(stmt, scope, loops, conds, guard, subst, depth, stack)

    def _walk_stmt(self, stmt: ast.stmt, scope: Func, loops: tuple[int, ...], conds: tuple[tuple[int, str], ...],
                   guard: frozenset[str], subst: dict[str, str], depth: int, stack: set[int]) -> None:
        w = self._walk_body
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            self._exprs(stmt.iter if isinstance(stmt, (ast.For, ast.AsyncFor)) else stmt.test, scope, loops, conds, guard,
                        subst, depth, stack)
            w(stmt.body, scope, (*loops, id(stmt)), conds, guard, subst, depth, stack)
            w(stmt.orelse, scope, loops, conds, guard, subst, depth, stack)
            return
        if isinstance(stmt, ast.If):
            self._exprs(stmt.test, scope, loops, conds, guard, subst, depth, stack)
            g = guard | frozenset(names_in(stmt.test))
            w(stmt.body, scope, loops, (*conds, (id(stmt), "body")), g, subst, depth, stack)
            w(stmt.orelse, scope, loops, (*conds, (id(stmt), "else")), g, subst, depth, stack)
            return
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self._exprs(item.context_expr, scope, loops, conds, guard, subst, depth, stack)
            w(stmt.body, scope, loops, conds, guard, subst, depth, stack)
            return
        if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            t: ast.Try = stmt  # type: ignore[assignment]
            w(t.body, scope, loops, (*conds, (id(t), "try")), guard, subst, depth, stack)
            for h in t.handlers:
                w(h.body, scope, loops, (*conds, (id(t), f"except{id(h)}")), guard, subst, depth, stack)
            w(t.orelse, scope, loops, (*conds, (id(t), "try")), guard, subst, depth, stack)
            w(t.finalbody, scope, loops, conds, guard, subst, depth, stack)
            return
        if isinstance(stmt, ast.Match):
            self._exprs(stmt.subject, scope, loops, conds, guard, subst, depth, stack)
            for i, case in enumerate(stmt.cases):
                w(case.body, scope, loops, (*conds, (id(stmt), f"case{i}")), guard, subst, depth, stack)
            return
        if isinstance(stmt, (ast.Continue, ast.Break)):
            self._emit("jump", stmt, loops, conds, guard, jump_loop=loops[-1] if loops else None)
            return
        if isinstance(stmt, (ast.Return, ast.Raise)):
            if stmt.value if isinstance(stmt, ast.Return) else stmt.exc:
                self._exprs(stmt, scope, loops, conds, guard, subst, depth, stack)
            if depth == 0:
                self._emit("jump", stmt, loops, conds, guard, jump_loop=-1)
            return
        self._exprs(stmt, scope, loops, conds, guard, subst, depth, stack)

    def _exprs(self, node: ast.AST, scope: Func, loops: tuple[int, ...], conds: tuple[tuple[int, str], ...],
               guard: frozenset[str], subst: dict[str, str], depth: int, stack: set[int]) -> None:
        calls = sorted((n for n in walk_scope(node) if isinstance(n, ast.Call)),
                       key=lambda c: (getattr(c, "end_lineno", 0), getattr(c, "end_col_offset", 0)))
        for c in calls:  # inner calls end first: `scaler.scale(loss).backward()` -> scale, then backward
            self._call(c, scope, loops, conds, guard, subst, depth, stack)

    def _name(self, node: ast.AST | None, subst: dict[str, str]) -> str | None:
        d = dotted(node)
        if d is None:
            return None
        head, _, rest = d.partition(".")
        if head in subst:
            return subst[head] + ("." + rest if rest else "")
        return d

    def _call(self, c: ast.Call, scope: Func, loops: tuple[int, ...], conds: tuple[tuple[int, str], ...],
              guard: frozenset[str], subst: dict[str, str], depth: int, stack: set[int]) -> None:
        f = self.facts
        name = call_name(c)
        m = method(c)
        emit = self._emit
        if last(name) in CLIP_FUNCS and not (m and f.is_scaler(dotted(m[0]))):
            owner = dotted(m[0]) if m else None
            if owner is None or owner in ("torch.nn.utils", "nn.utils", "utils", "clip_grad") or owner.endswith("nn.utils"):
                emit("clip", c, loops, conds, guard, params=arg(c, 0, "parameters"))
                return
        if last(name) in ("nan_to_num", "nan_to_num_") and any(".grad" in (dotted(n) or "") or
                                                              (isinstance(n, ast.Attribute) and n.attr == "grad")
                                                              for n in ast.walk(c)):
            emit("nan_grad", c, loops, conds, guard)
            return
        if m is not None:
            recv, meth = m
            rname = self._name(recv, subst)
            if meth == "backward":
                inner = method(recv)
                if inner and inner[1] == "scale" and f.is_scaler(self._name(inner[0], subst)):
                    emit("scale_backward", c, loops, conds, guard, scaler=self._name(inner[0], subst))
                elif isinstance(recv, ast.Name) and self._scaled_name(recv.id, scope):
                    emit("scale_backward", c, loops, conds, guard, scaler=self._scaled_name(recv.id, scope))
                else:
                    emit("backward", c, loops, conds, guard)
                return
            if f.is_scaler(rname):
                if meth == "unscale_":
                    emit("unscale", c, loops, conds, guard, scaler=rname, optimizer=self._name(arg(c, 0, "optimizer"), subst))
                elif meth == "step":
                    emit("step", c, loops, conds, guard, scaler=rname, optimizer=self._name(arg(c, 0, "optimizer"), subst))
                elif meth == "update":
                    emit("update", c, loops, conds, guard, scaler=rname)
                return
            if meth == "step" and rname is not None and rname in f.optimizers:
                emit("opt_step", c, loops, conds, guard, optimizer=rname)
                return
        if name == "torch.autograd.backward":
            emit("backward", c, loops, conds, guard)
            return
        if depth < 2:
            callee = f.resolve(c, scope)
            if callee is not None and id(callee) not in stack and callee.node is not scope.node:
                binds = {p: n for p, a in bind(callee, c) if (n := self._name(a, subst))}
                self._walk_body(self._body(callee), callee, loops, conds, guard, binds, depth + 1, stack | {id(callee)})

    def _scaled_name(self, var: str, scope: Func) -> str | None:
        """``scaled = scaler.scale(loss); scaled.backward()``: the scaler behind ``scaled``."""
        for v in self.facts.assigned(var, scope):
            m = method(v)
            if m and m[1] == "scale" and self.facts.is_scaler(dotted(m[0])):
                return dotted(m[0])
        return None
