"""What one file says, read from its syntax tree alone: names, scopes, the functions and what they bind
(``FileFacts``), and the autocast regions. The training events of each function are ``lint.events``'; the
names and literals read from a node, ``lint.syntax``'.

Nothing here imports or runs the user's code. Every fact is a guess that can be checked from the text:
when a name cannot be followed, the fact is left unknown and the rules that need it stay silent.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from ampdoctor.lint.syntax import (
    BF16_NAMES,
    MOVE_METHODS,
    OPTIMIZERS,
    SCALER_CLASSES,
    arg,
    call_name,
    device_literal,
    dotted,
    fp16_dtype,
    last,
    method,
)


@dataclass
class Region:
    """An autocast region: its device ('cuda', 'cpu' or None: unknown) and dtype ('fp16', 'bf16', None: unknown)."""

    device: str | None
    dtype: str | None
    node: ast.AST

    @property
    def fp16(self) -> bool:
        return self.dtype == "fp16"


@dataclass
class Func:
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Module
    qual: str
    cls: ast.ClassDef | None
    parent: Func | None
    params: list[str] = field(default_factory=list)
    local_defs: dict[str, Func] = field(default_factory=dict)


class FileFacts:
    """The facts of one parsed file that several rules share."""

    def __init__(self, tree: ast.Module, source: str, *, amp: bool = False) -> None:
        self.tree = tree
        self.source = source
        self.assume_amp = amp
        self._fp16: bool | None = None
        self._bf16: bool | None = None
        self.nodes: list[ast.AST] = [tree]
        """Every node of the file, in ``ast.walk``'s order: the one walk of the whole tree the rules share."""
        self.parent: dict[ast.AST, ast.AST] = {}
        nodes, parent, node_t = self.nodes, self.parent, ast.AST
        i = 0
        while i < len(nodes):  # (breadth first, as ast.walk; the parent of each node taken in the same pass;
            p = nodes[i]  # the fields read directly, as ast.iter_child_nodes does, without its generators)
            i += 1
            for name in p._fields:
                v = getattr(p, name, None)
                if isinstance(v, node_t):
                    parent[v] = p
                    nodes.append(v)
                elif isinstance(v, list):
                    for c in v:
                        if isinstance(c, node_t):
                            parent[c] = p
                            nodes.append(c)
        self.classes: dict[str, ast.ClassDef] = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.imports: dict[str, str] = {}
        for n in self.nodes:
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                for a in n.names:
                    self.imports[a.asname or a.name] = f"{n.module}.{a.name}"
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.asname:
                        self.imports[a.asname] = a.name
        self.funcs: list[Func] = []
        self.module = Func(tree, "<module>", None, None)
        self.top: dict[str, Func] = {}
        self.func_of: dict[ast.AST, Func] = {tree: self.module}
        self._collect(tree.body, self.module, None)
        self.calls = [n for n in self.nodes if isinstance(n, ast.Call)]
        self.scalers = self._scalers()
        self.optimizers = self._optimizers()
        self.regions = self._regions()

    def may_step(self) -> set[int]:
        """The functions (ids of their ``Func``) whose events may hold an optimizer or scaler ``step`` call: one in
        their own body, or in a same-file function they call, two calls deep as ``Events`` inlines them. Matched by
        the called name's last part (more than ``resolve`` finds, never less; a ``forward`` that steps makes every
        function a candidate). The rules that read events all need a step: the others' events are never built."""
        own: dict[int, set[str]] = {}
        direct: set[int] = set()
        for c in self.calls:
            fn = id(self.scope_of(c))
            m = method(c)
            if m is not None and m[1] == "step":
                direct.add(fn)
            own.setdefault(fn, set()).add(last(call_name(c)))
        every = [self.module, *self.funcs]
        hit = set(direct)
        for _ in range(2):
            names = {f.node.name for f in self.funcs if id(f) in hit}  # type: ignore[union-attr]
            if "forward" in names:  # model(x) resolves to a forward by the class, not by the name called
                return {id(f) for f in every}
            hit |= {id(f) for f in every if own.get(id(f), set()) & names}
        return hit

    def canon(self, name: str | None) -> str:
        """A dotted name with its first part's import spelled out: 'amp.autocast' -> 'torch.cuda.amp.autocast'."""
        if not name:
            return ""
        head, _, rest = name.partition(".")
        full = self.imports.get(head)
        return (full + ("." + rest if rest else "")) if full else name

    # scopes
    def _collect(self, body: list[ast.stmt], parent: Func, cls: ast.ClassDef | None) -> None:
        for node in body:
            for n in _defs(node):
                if isinstance(n, ast.ClassDef):
                    self._collect(n.body, parent, n)
                    continue
                qual = f"{cls.name}.{n.name}" if cls is not None else (n.name if parent is self.module else f"{parent.qual}.{n.name}")
                f = Func(n, qual, cls, parent, [a.arg for a in [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs]])
                self.funcs.append(f)
                self.func_of[n] = f
                if cls is None:
                    parent.local_defs[n.name] = f
                    if parent is self.module:
                        self.top[n.name] = f
                self._collect(n.body, f, None)

    def scope_of(self, node: ast.AST) -> Func:
        """The function (or the module) whose body holds ``node``."""
        n: ast.AST | None = node
        while n is not None:
            n = self.parent.get(n)
            if n is not None and n in self.func_of:
                return self.func_of[n]
        return self.module

    def method_of(self, cls: ast.ClassDef, name: str) -> Func | None:
        for n in cls.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                return self.func_of.get(n)
        for b in cls.bases:  # a base class of the same file
            base = self.classes.get(dotted(b) or "")
            if base is not None and base is not cls:
                found = self.method_of(base, name)
                if found is not None:
                    return found
        return None

    def resolve(self, call: ast.Call, scope: Func) -> Func | None:
        """The same-file function a call runs: f(), a nested def, self.m(), or a Module's forward for
        ``model(x)`` / ``self.block(x)`` when the name is bound to a class of this file."""
        cache = self.__dict__.setdefault("_resolve_cache", {})
        key = (id(call), id(scope))
        if key not in cache:
            cache[key] = self._resolve(call, scope)
        return cache[key]  # type: ignore[no-any-return]

    def _resolve(self, call: ast.Call, scope: Func) -> Func | None:
        name = call_name(call)
        if name is None:
            return None
        if "." not in name:
            s: Func | None = scope
            while s is not None:
                if name in s.local_defs:
                    return s.local_defs[name]
                s = s.parent
            cls = self.class_of_name(name, scope)
            return self.method_of(cls, "forward") if cls is not None else None
        if name.startswith("self.") and scope.cls is not None and name.count(".") == 1:
            m = self.method_of(scope.cls, name[5:])
            if m is not None:
                return m
            cls = self.class_of_name(name, scope)
            return self.method_of(cls, "forward") if cls is not None else None
        return None

    def class_of_name(self, name: str, scope: Func) -> ast.ClassDef | None:
        """The class of this file a name is bound to (``model = Net(...)``, ``self.attn = Attention(...)``)."""
        where: list[ast.AST] = [scope.node, self.tree]
        if name.startswith("self.") and scope.cls is not None:
            init = self.method_of(scope.cls, "__init__")
            where = [init.node] if init is not None else []
        for w in where:
            for v in self._assigns(w).get(name, []):
                k = _strip_moves(v)
                cls = self.classes.get(call_name(k) or "") if isinstance(k, ast.Call) else None
                if cls is not None:
                    return cls
        return None

    def _assigns(self, node: ast.AST) -> dict[str, list[ast.expr]]:
        """name -> values assigned to it in a scope (not in its nested functions), computed once."""
        cache = self.__dict__.setdefault("_assign_cache", {})
        got = cache.get(id(node))
        if got is not None:
            return got
        out: dict[str, list[ast.expr]] = {}
        for n in walk_scope(node):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    d = dotted(t)
                    if d:
                        out.setdefault(d, []).append(n.value)
            elif isinstance(n, ast.AnnAssign) and n.value is not None:
                d = dotted(n.target)
                if d:
                    out.setdefault(d, []).append(n.value)
        cache[id(node)] = out
        return out

    def assigned(self, name: str, scope: Func) -> list[ast.expr]:
        """Every value assigned to ``name`` in the scope, else in the module (``x = v``, ``x: T = v``)."""
        for w in (scope.node, self.tree) if scope.node is not self.tree else (self.tree,):
            vals = self._assigns(w).get(name)
            if vals:
                return list(vals)
        return []

    # names
    def _scalers(self) -> set[str]:
        """Names that hold a GradScaler: assigned one, or used as one (``x.unscale_(opt)``, ``x.scale(loss).backward()``)."""
        out: set[str] = set()
        for n in self.nodes:
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
                v = n.value
                if isinstance(v, ast.IfExp):
                    v = v.body if isinstance(v.body, ast.Call) else v.orelse
                if isinstance(v, ast.Call) and last(call_name(v)) in SCALER_CLASSES:
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    out.update(d for d in (dotted(t) for t in targets) if d)
        for c in self.calls:
            m = method(c)
            if m is None:
                continue
            recv, name = m
            if name == "unscale_" and dotted(recv):
                out.add(dotted(recv))  # type: ignore[arg-type]
            if name == "backward":
                inner = method(recv)
                if inner and inner[1] == "scale" and dotted(inner[0]):
                    out.add(dotted(inner[0]))  # type: ignore[arg-type]
        for c in self.calls if out else []:  # a helper's parameter that a caller passes a scaler to
            f = self.resolve(c, self.scope_of(c))
            if f is not None:
                for p, a in bind(f, c):
                    if dotted(a) in out:
                        out.add(p)
        return out

    def is_scaler(self, name: str | None) -> bool:
        return bool(name) and (name in self.scalers or last(name) in {last(s) for s in self.scalers})

    def has_scaler(self) -> bool:
        return self.assume_amp or bool(self.scalers)

    def _optimizers(self) -> dict[str, ast.Call | None]:
        """Optimizer names -> the constructor call when seen (``opt = torch.optim.AdamW(model.parameters())``)."""
        out: dict[str, ast.Call | None] = {}
        for n in self.nodes:
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and last(call_name(n.value)) in OPTIMIZERS:
                for t in n.targets:
                    if dotted(t):
                        out[dotted(t)] = n.value  # type: ignore[index]
        for c in self.calls:
            m = method(c)
            if m and m[1] in ("step", "unscale_") and self.is_scaler(dotted(m[0])) and c.args:
                d = dotted(c.args[0])
                if d and d not in out:
                    out[d] = None
        return out

    def fp16_possible(self) -> bool:
        """The file may run FP16: GradScaler, float16/half, CUDA autocast without a dtype (worked out once)."""
        if self._fp16 is None:
            self._fp16 = self._fp16_possible()
        return self._fp16

    def _fp16_possible(self) -> bool:
        if self.has_scaler():
            return True
        for n in self.nodes:
            d = dotted(n) if isinstance(n, (ast.Name, ast.Attribute)) else None
            if d in ("torch.float16", "torch.half"):
                return True
            if isinstance(n, ast.Constant) and n.value in ("float16", "fp16", "16-mixed"):
                return True
            m = method(n)
            if m and m[1] == "half":
                return True
        return any(r.dtype in ("fp16", None) for r in self.regions.values())

    def _bf16_named(self) -> bool:
        if self._bf16 is None:
            self._bf16 = any(dotted(n) in BF16_NAMES or (isinstance(n, ast.Constant) and n.value in ("bfloat16", "bf16", "bf16-mixed"))
                             for n in self.nodes)
        return self._bf16

    def reduced_precision(self) -> bool:
        """The file may run in FP16 or BF16 (or ``--amp`` says it does)."""
        return self.fp16_possible() or self._bf16_named()

    def bf16_only(self) -> bool:
        """Decidably BF16 (or FP32) only: bfloat16 named and nothing that may be FP16."""
        return not self.fp16_possible() and self._bf16_named()

    # autocast
    def autocast_of(self, expr: ast.expr, scope: Func, depth: int = 0) -> Region | None | bool:
        """The region a ``with`` item opens: a Region, False (autocast disabled), or None (not autocast)."""
        if isinstance(expr, ast.Name) and depth < 2:
            values = self.assigned(expr.id, scope)
            for v in values:
                r = self.autocast_of(v, scope, depth + 1)
                if r not in (None, False):
                    return r
            return None
        if isinstance(expr, ast.IfExp):
            for side in (expr.body, expr.orelse):
                r = self.autocast_of(side, scope, depth + 1)
                if isinstance(r, Region):
                    return Region(r.device, None if r.dtype == "fp16" else r.dtype, r.node)  # maybe not at all
            return None
        if not isinstance(expr, ast.Call):
            return None
        name = self.canon(call_name(expr))
        if last(name) != "autocast":
            return None
        if not name.startswith("torch.") and name != "autocast":
            return Region(None, None, expr)  # accelerator.autocast(): the precision is the launcher's
        first = expr.args[0] if expr.args else None
        modern = (isinstance(first, ast.Constant) and isinstance(first.value, str)) or any(k.arg == "device_type" for k in expr.keywords) \
            or name in ("torch.autocast", "torch.amp.autocast")
        if modern:
            dev = arg(expr, 0, "device_type")
            device = device_literal(dev) if dev is not None else None
            en, dt_node = arg(expr, 2, "enabled"), arg(expr, 1, "dtype")
        else:  # torch.cuda.amp.autocast(enabled, dtype) / torch.cpu.amp.autocast
            device = "cpu" if name.startswith("torch.cpu") else "cuda"
            en, dt_node = arg(expr, 0, "enabled"), arg(expr, 1, "dtype")
        if isinstance(en, ast.Constant) and en.value is False:
            return False
        if dt_node is None:
            dtype = "fp16" if device == "cuda" else "bf16" if device == "cpu" else None
        else:
            dtype = fp16_dtype(dt_node)
        if en is not None and not isinstance(en, ast.Constant) and dtype == "fp16":
            dtype = None  # enabled at run time only: maybe FP32
        return Region(device, dtype, expr)

    def _regions(self) -> dict[ast.AST, Region]:
        """Each function body or ``with`` statement that runs under autocast -> its region. Functions called
        from a region (up to three calls deep, same file) run under it too."""
        out: dict[ast.AST, Region] = {}
        todo: list[tuple[Func, Region, int]] = []
        for n in self.nodes:
            if isinstance(n, (ast.With, ast.AsyncWith)):
                scope = self.scope_of(n)
                for item in n.items:
                    r = self.autocast_of(item.context_expr, scope)
                    if isinstance(r, Region):
                        out[n] = r
                        todo += [(f, r, 1) for f in self._called_in(n.body, scope)]
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in n.decorator_list:
                    r = self.autocast_of(dec, self.scope_of(n)) if isinstance(dec, ast.Call) else None
                    if isinstance(r, Region):
                        out[n] = r
                        f = self.func_of[n]
                        todo += [(g, r, 1) for g in self._called_in(n.body, f)]
        rank = {"fp16": 2, None: 1, "bf16": 0, "fp32": 0}
        own = set(out)  # a function's own decorator or with-block decides for itself
        while todo:
            f, r, depth = todo.pop()
            have = out.get(f.node)
            if f.node in own or (have is not None and rank[have.dtype] >= rank[r.dtype]):
                continue  # a function called from several regions runs under the most FP16 of them
            out[f.node] = r
            if depth < 3:
                todo += [(g, r, depth + 1) for g in self._called_in(f.node.body, f)]
        return out

    def _called_in(self, body: list[ast.stmt], scope: Func) -> Iterator[Func]:
        for stmt in body:
            for n in walk_scope(stmt):
                if isinstance(n, ast.Call):
                    f = self.resolve(n, scope)
                    if f is not None:
                        yield f

    def region(self, node: ast.AST) -> Region | None:
        """The autocast region that ``node`` runs under (the innermost), None outside autocast."""
        n: ast.AST | None = node
        while n is not None:
            n = self.parent.get(n)
            if n is None:
                return None
            if isinstance(n, (ast.With, ast.AsyncWith)):
                scope = self.scope_of(n)
                for item in n.items:
                    r = self.autocast_of(item.context_expr, scope)
                    if r is False:
                        return None
                if n in self.regions:
                    return self.regions[n]
            if n in self.regions:
                return self.regions[n]
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return self.regions.get(n)
        return None


def _defs(node: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
    """Function and class definitions directly in a statement (inside if/try/with blocks too)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node
        return
    for field_name in ("body", "orelse", "finalbody", "handlers"):
        for child in getattr(node, field_name, []) or []:
            yield from _defs(child)


def walk_scope(node: ast.AST) -> Iterator[ast.AST]:
    """ast.walk that does not enter nested functions, lambdas or classes (their names are their own)."""
    todo = [node]
    first = True
    while todo:
        n = todo.pop()
        if not first and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        first = False
        yield n
        todo.extend(reversed(list(ast.iter_child_nodes(n))))


def _strip_moves(node: ast.expr) -> ast.expr:
    """``Net(...).to(device).half()`` -> ``Net(...)``."""
    while True:
        m = method(node)
        if m and m[1] in MOVE_METHODS:
            node = m[0]
        else:
            return node


def bind(f: Func, call: ast.Call) -> list[tuple[str, ast.expr]]:
    """(parameter, argument) pairs of a call to ``f`` (``self`` skipped for methods)."""
    params = list(f.params)
    if f.cls is not None and params and params[0] in ("self", "cls"):
        params = params[1:]
    out = [(p, a) for p, a in zip(params, call.args, strict=False) if not isinstance(a, ast.Starred)]
    out += [(k.arg, k.value) for k in call.keywords if k.arg in params]
    return out
