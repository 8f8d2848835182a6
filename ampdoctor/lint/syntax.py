"""Names and literals read from a syntax tree alone: the dotted name of an expression or a call, a call's
argument, a number, the names an expression reads, the root of a chain of calls, a cast to float, an FP16 dtype, a
device literal; and the names the lint knows (GradScaler's classes, the optimizers, the clip functions, the FP16
and BF16 dtype spellings, the methods that move a model)."""

from __future__ import annotations

import ast

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
