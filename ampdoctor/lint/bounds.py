"""What an expression can be, from its text: an interval its value lies in, and the forms a rule looks for
that no name gives away.

``bounds(expr, facts, scope)`` is interval arithmetic over the ``ast``: a constant is its own interval, ``-x``,
``x + y``, ``x - y``, ``x * y`` and ``x / y`` combine their operands' intervals, ``x ** 2`` (any even integer power),
``abs``, ``square``, ``relu``, ``exp``, ``sqrt`` and the norms are at least 0, ``sigmoid`` lies in [0, 1], ``tanh``,
``sin`` and ``cos`` in [-1, 1], ``clamp(min=a, max=b)`` cuts the interval, ``sum`` keeps a sign and ``mean`` an
interval; a name assigned once in its scope is followed (two hops at most). Anything else may be any value. So
``-((i - c) ** 2) / (2 * w ** 2)``, a Gaussian profile's exponent, is at most 0 (a non-positive numerator over a
non-negative denominator) whatever the names: ``exp`` of it is at most 1 and cannot overflow, a division by zero
included (``-x / 0`` is -inf or NaN, never a large positive value).

``product_constants(node)``: the constant factor of a product handed on whole (``return (1.0 - mask) * -1e9``, an
argument ``attn_mask=mask * -1e9``): the extended attention mask idiom, added to the scores where it is used.
``direct_hook(call)``: the function a ``register_hook`` call registers when it is a library function passed itself
(``p.register_hook(torch.nan_to_num)``, ``partial(torch.clamp, min=-1, max=1)``), not a lambda or a def.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterator
from typing import Any

from ampdoctor.lint.flow import FileFacts, Func
from ampdoctor.lint.syntax import arg, call_name, dotted, last, method, number

Interval = tuple[float, float]
ANY: Interval = (-math.inf, math.inf)
NONNEG: Interval = (0.0, math.inf)

_AT_LEAST_0 = {"abs", "absolute", "square", "relu", "relu6", "exp", "exp2", "sqrt", "norm", "softplus", "cosh",
               "vector_norm", "matrix_norm", "frobenius_norm", "var", "std", "gelu_nonneg"}
_UNIT = {"sigmoid": (0.0, 1.0), "tanh": (-1.0, 1.0), "sin": (-1.0, 1.0), "cos": (-1.0, 1.0),
         "softmax": (0.0, 1.0), "hardsigmoid": (0.0, 1.0), "hardtanh": (-1.0, 1.0), "erf": (-1.0, 1.0),
         "logsigmoid": (-math.inf, 0.0)}
_KEEP = {"float", "double", "half", "bfloat16", "to", "type_as", "contiguous", "clone", "detach", "view", "reshape",
         "flatten", "squeeze", "unsqueeze", "transpose", "permute", "expand", "expand_as", "view_as", "t", "mean",
         "amax", "amin", "max", "min"}
"""Calls whose value lies in the interval of the tensor they are called on (casts, views, a mean, a max)."""
_MODULES = {"torch", "F", "torch.nn.functional", "nn.functional", "math", "np", "numpy", "torch.special", "special"}
"""Receivers that are modules, not tensors: ``torch.exp(x)`` is a function of its first argument."""


def _mul(a: Interval, b: Interval) -> Interval:
    vals = []
    for x in a:
        for y in b:
            v = x * y
            if math.isnan(v):  # 0 x inf: the product of a bounded 0 and an unbounded side can be anything there
                return ANY
            vals.append(v)
    return min(vals), max(vals)


def _div(a: Interval, b: Interval) -> Interval:
    if b[0] > 0 or b[1] < 0:
        inv = (1.0 / b[1], 1.0 / b[0])  # (1/x falls on each side of 0; 1/inf is 0)
        return _mul(a, (min(inv), max(inv)))
    if b[0] >= 0:  # a divisor that is >= 0 but may be 0: the quotient keeps the numerator's sign (or is +-inf, NaN)
        return (0.0, math.inf) if a[0] >= 0 else (-math.inf, 0.0) if a[1] <= 0 else ANY
    if b[1] <= 0:
        return (-math.inf, 0.0) if a[0] >= 0 else (0.0, math.inf) if a[1] <= 0 else ANY
    return ANY


def _pow(base: Interval, e: float | None) -> Interval:
    if e is None:
        return ANY
    if float(e).is_integer() and int(e) % 2 == 0 and e > 0:
        m = max(abs(base[0]), abs(base[1]))
        lo = 0.0 if base[0] <= 0 <= base[1] else min(abs(base[0]), abs(base[1])) ** e
        return lo, (m**e if math.isfinite(m) else math.inf)
    if base[0] >= 0:
        return NONNEG
    return ANY


class Bounds:
    """``Bounds(facts, scope)(expr)``: an interval the value of ``expr`` lies in (``ANY`` where it cannot tell)."""

    def __init__(self, facts: FileFacts, scope: Func, hops: int = 2) -> None:
        self.f, self.scope, self.hops = facts, scope, hops

    def __call__(self, node: ast.AST) -> Interval:
        x = number(node)
        if x is not None:
            return (x, x)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            lo, hi = self(node.operand)
            return -hi, -lo
        if isinstance(node, ast.BinOp):
            return self._binop(node)
        if isinstance(node, ast.Name):
            return self._name(node.id)
        if isinstance(node, ast.Call):
            return self._call(node)
        return ANY

    def _binop(self, n: ast.BinOp) -> Interval:
        if isinstance(n.op, ast.Pow):
            return _pow(self(n.left), number(n.right))
        a, b = self(n.left), self(n.right)
        if isinstance(n.op, ast.Add):
            return a[0] + b[0], a[1] + b[1]
        if isinstance(n.op, ast.Sub):
            return a[0] - b[1], a[1] - b[0]
        if isinstance(n.op, ast.Mult):
            if ast.dump(n.left) == ast.dump(n.right):  # x * x
                return _pow(a, 2.0)
            return _mul(a, b)
        if isinstance(n.op, ast.Div):
            return _div(a, b)
        return ANY

    def _name(self, name: str) -> Interval:
        if self.hops <= 0:
            return ANY
        values = self.f.assigned(name, self.scope)
        if len(values) != 1:
            return ANY  # (assigned in several places, or a parameter: any value)
        return Bounds(self.f, self.scope, self.hops - 1)(values[0])

    def _call(self, c: ast.Call) -> Interval:
        m = method(c)
        first: ast.AST | None
        if m is not None and dotted(m[0]) not in _MODULES:
            name, first, rest = m[1], m[0], 0  # x.abs(): the tensor is the receiver
        else:
            name, first, rest = last(call_name(c)), (c.args[0] if c.args else None), 1
        if first is None:
            return ANY
        inner = self(first)
        if name in _AT_LEAST_0:
            return max(inner[0], 0.0) if name in ("relu", "relu6") else 0.0, math.inf
        if name in _UNIT:
            return _UNIT[name]
        if name in ("pow", "float_power"):
            e = arg(c, rest, "exponent")
            return _pow(inner, number(e))
        if name in ("neg", "negative"):
            return -inner[1], -inner[0]
        if name in ("clamp", "clip", "clamp_max", "clamp_min"):
            lo = number(arg(c, rest, "min")) if name in ("clamp", "clip", "clamp_min") else None
            hi_n = arg(c, rest + 1, "max") if name in ("clamp", "clip") else arg(c, rest, "max") if name == "clamp_max" else None
            hi = number(hi_n)
            return (max(inner[0], lo) if lo is not None else inner[0], min(inner[1], hi) if hi is not None else inner[1])
        if name in ("sum", "cumsum"):
            return (0.0, math.inf) if inner[0] >= 0 else (-math.inf, 0.0) if inner[1] <= 0 else ANY
        if name in _KEEP:
            return inner
        return ANY


EXP_MAX = math.log(65504.0)
"""The largest exponent whose exp fits FP16 (11.09)."""


def exponent_fits(facts: FileFacts, scope: Func, x: ast.AST) -> bool:
    """``exp(x)`` cannot overflow FP16: ``x`` is at most log(65504) whatever the values it is made of."""
    return Bounds(facts, scope)(x)[1] <= EXP_MAX


def product_constants(facts: FileFacts) -> Iterator[tuple[ast.AST, float]]:
    """(constant node, its value) for each product with a negative constant factor whose other factor is not a
    constant, handed on whole: returned, passed as an argument, or a lambda's value (the forms assigned or added in
    place are the mask rules' own)."""
    for n in facts.nodes:
        if not (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)):
            continue
        p: Any = facts.parent.get(n)
        handed = isinstance(p, (ast.Return, ast.Lambda, ast.keyword)) or (isinstance(p, ast.Call) and n in p.args)
        if not handed:
            continue
        for side in (n.left, n.right):
            y = number(side)
            other = n.right if side is n.left else n.left
            if y is not None and y < 0 and not isinstance(side, ast.BinOp) and number(other) is None:
                yield side, y


HOOK_FUNCS = {"nan_to_num", "nan_to_num_", "clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_max"}


def direct_hook(call: ast.Call) -> str | None:
    """The library function (its last name) a hook registration passes itself: ``p.register_hook(torch.nan_to_num)``,
    ``register_hook(partial(torch.clamp, min=-1, max=1))``; None for a lambda, a def of the file, anything else."""
    if not call.args:
        return None
    fn: ast.AST = call.args[0]
    if isinstance(fn, ast.Call) and last(call_name(fn)) == "partial" and fn.args:
        fn = fn.args[0]
    if not isinstance(fn, ast.Attribute):
        return None  # (a bare name is a def of the file or an import: the hook rules follow a def themselves)
    name = dotted(fn)
    if name is None or not name.startswith(("torch.", "th.")):
        return None
    return fn.attr if fn.attr in HOOK_FUNCS else None


__all__ = ["ANY", "EXP_MAX", "Bounds", "direct_hook", "exponent_fits", "product_constants"]
