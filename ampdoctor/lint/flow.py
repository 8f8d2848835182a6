"""What one file says, read from its syntax tree alone: names, scopes, the training events of each
function in source order (helpers of the same file inlined), and the autocast regions.

Nothing here imports or runs the user's code. Every fact is a guess that can be checked from the text:
when a name cannot be followed, the fact is left unknown and the rules that need it stay silent.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

SCALER_CLASSES = {"GradScaler", "ShardedGradScaler"}
OPTIMIZERS = {"Adam", "AdamW", "SGD", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "LBFGS",
              "SparseAdam", "ASGD", "Adafactor", "Lamb", "LAMB", "FusedAdam", "FusedLAMB", "Lion", "AdamW8bit", "Adam8bit"}
EPS_OPTIMIZERS = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam", "FusedAdam",
                  "Lamb", "LAMB", "FusedLAMB", "AdamW8bit", "Adam8bit"}
"""Optimizers whose update divides by sqrt(v) + eps (eps=1e-8 by default: 0 in FP16)."""
CLIP_FUNCS = {"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grad_value"}
FP16_NAMES = {"torch.float16", "torch.half", "float16", "half"}
BF16_NAMES = {"torch.bfloat16", "bfloat16"}
MOVE_METHODS = {"to", "cuda", "half", "float", "train", "eval", "bfloat16", "double", "requires_grad_", "cpu"}


def dotted(node: ast.AST | None) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def call_name(node: ast.AST) -> str | None:
    """The dotted name of a call's function ('torch.nn.utils.clip_grad_norm_'), else None."""
    return dotted(node.func) if isinstance(node, ast.Call) else None


def last(name: str | None) -> str:
    return name.rsplit(".", 1)[-1] if name else ""


def method(node: ast.AST) -> tuple[ast.expr, str] | None:
    """(receiver, method name) of a call ``recv.m(...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.value, node.func.attr
    return None


def arg(call: ast.Call, i: int, name: str) -> ast.expr | None:
    """Positional argument ``i`` or keyword ``name`` of a call."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if i < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: i + 1]):
        return call.args[i]
    return None


def number(node: ast.AST | None) -> float | None:
    """A numeric literal, with its sign: -1e9, 1e4, float('-inf') -> float; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = number(node.operand)
        if v is None:
            return None
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Call) and call_name(node) == "float" and len(node.args) == 1 \
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        try:
            return float(node.args[0].value)
        except ValueError:
            return None
    return None


def names_in(node: ast.AST) -> set[str]:
    """Every dotted name (and its prefixes) mentioned in an expression."""
    out: set[str] = set()
    for n in ast.walk(node):
        d = dotted(n) if isinstance(n, (ast.Name, ast.Attribute)) else None
        if d:
            parts = d.split(".")
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def root_of(node: ast.AST | None) -> str | None:
    """The model a ``X.parameters()``-like expression comes from: 'model' for model.parameters(),
    model.module.parameters(), list(model.parameters()), [p for p in model.parameters() if ...]."""
    if node is None:
        return None
    for n in ast.walk(node):
        m = method(n)
        if m and m[1] in ("parameters", "named_parameters"):
            d = dotted(m[0])
            if d:
                return d.removesuffix(".module")
    return None


def casts_to_float(node: ast.AST) -> bool:
    """The expression holds ``.float()``, ``.double()`` or ``.to(torch.float32)``: computed in FP32."""
    for n in ast.walk(node):
        m = method(n)
        if m and m[1] in ("float", "double"):
            return True
        if m and m[1] == "to" and any(dotted(a) in ("torch.float32", "torch.float", "torch.float64", "torch.double")
                                      for a in [*n.args, *(k.value for k in n.keywords)]):  # type: ignore[attr-defined]
            return True
    return False


def fp16_dtype(node: ast.AST | None) -> str | None:
    """'fp16' / 'bf16' / 'fp32' for a dtype literal, else None."""
    d = dotted(node) if node is not None else None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        d = node.value
    if d in FP16_NAMES:
        return "fp16"
    if d in BF16_NAMES:
        return "bf16"
    if d in ("torch.float32", "torch.float", "float32"):
        return "fp32"
    return None


def device_literal(node: ast.AST | None) -> str | None:
    """'cuda' / 'cpu' / ... for "cuda:0", torch.device('cuda'), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        kind = node.value.split(":")[0].strip()
        return kind if kind in ("cuda", "cpu", "mps", "xpu", "hpu", "xla", "npu") else None
    if isinstance(node, ast.Call) and call_name(node) in ("torch.device", "device") and node.args:
        return device_literal(node.args[0])
    return None


# --- the file ---------------------------------------------------------------------------------------------------------


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
        for n in _walk_scope(node):
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
                for p, a in _bind(f, c):
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
            for n in _walk_scope(stmt):
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


def _walk_scope(node: ast.AST) -> Iterator[ast.AST]:
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


def _bind(f: Func, call: ast.Call) -> list[tuple[str, ast.expr]]:
    """(parameter, argument) pairs of a call to ``f`` (``self`` skipped for methods)."""
    params = list(f.params)
    if f.cls is not None and params and params[0] in ("self", "cls"):
        params = params[1:]
    out = [(p, a) for p, a in zip(params, call.args, strict=False) if not isinstance(a, ast.Starred)]
    out += [(k.arg, k.value) for k in call.keywords if k.arg in params]
    return out


# --- events -----------------------------------------------------------------------------------------------------------


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
        calls = sorted((n for n in _walk_scope(node) if isinstance(n, ast.Call)),
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
                binds = {p: n for p, a in _bind(callee, c) if (n := self._name(a, subst))}
                self._walk_body(self._body(callee), callee, loops, conds, guard, binds, depth + 1, stack | {id(callee)})

    def _scaled_name(self, var: str, scope: Func) -> str | None:
        """``scaled = scaler.scale(loss); scaled.backward()``: the scaler behind ``scaled``."""
        for v in self.facts.assigned(var, scope):
            m = method(v)
            if m and m[1] == "scale" and self.facts.is_scaler(dotted(m[0])):
                return dotted(m[0])
        return None
