"""The gradient and tensor hooks the user's code put on a model, by name (never the code objects).

A hook that rewrites gradients between backward and ``unscale_`` (``nan_to_num``, a clamp) can turn the
infs GradScaler must see into finite values: GradScaler then applies the step. ``found`` lists them
(parameter ``register_hook`` and ``register_post_accumulate_grad_hook``, module full backward hooks and
backward pre-hooks) as plain data for the capture's manifest and the report; ``disabled`` takes them off
for one backward, so a replay can tell what the gradients were before them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ampdoctor.records import MODEL, UserHook
from ampdoctor.watch.model_view import unwrap

_KINDS = (
    ("parameter", "_backward_hooks", "gradient hook"),
    ("parameter", "_post_accumulate_grad_hooks", "post-accumulate-grad hook"),
    ("module", "_backward_hooks", "full backward hook"),
    ("module", "_backward_pre_hooks", "backward pre-hook"),
)
_OPS = ("nan_to_num", "clamp", "clip", "where", "zero_", "fill_", "masked_fill", "isfinite", "isnan", "isinf")
"""Operations whose name in a hook's source line says what it does to the gradient."""


def _own(fn: Any) -> bool:
    """A hook of ampdoctor's own (the ``Probe``'s): never listed, never taken off."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return str(getattr(fn, "__module__", "") or "").startswith("ampdoctor.")


def describe_hook(fn: Any) -> tuple[str, str, str]:
    """(qualified name, 'file:line', the source line) of a hook function; '' where it cannot be said."""
    base = fn
    while isinstance(base, functools.partial):
        base = base.func
    qual = f"{getattr(base, '__module__', '') or ''}.{getattr(base, '__qualname__', type(base).__name__)}".lstrip(".")
    where = line = ""
    try:
        code = getattr(base, "__code__", None)
        if code is None and not isinstance(base, type):  # a callable object: its __call__'s code
            code = getattr(type(base).__call__, "__code__", None)
        if code is not None:
            where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
            lines, _ = inspect.getsourcelines(base)
            line = " ".join(x.strip() for x in lines[:3])[:200]
    except (OSError, TypeError):
        pass
    return qual, where, line


def found(model: nn.Module) -> list[UserHook]:
    """Every gradient / tensor hook on the model's parameters and backward hook on its modules, in module order."""
    inner = unwrap(model)
    out: list[UserHook] = []
    for mname, m in inner.named_modules():
        for target, attr, kind in _KINDS:
            if target != "module":
                continue
            for fn in list((getattr(m, attr, None) or {}).values()):
                if not _own(fn):
                    q, w, line = describe_hook(fn)
                    out.append(UserHook(kind, "module", mname or MODEL, q, w, _ops(line)))
    for pname, p in inner.named_parameters():
        for target, attr, kind in _KINDS:
            if target != "parameter":
                continue
            for fn in list((getattr(p, attr, None) or {}).values()):
                if not _own(fn):
                    q, w, line = describe_hook(fn)
                    out.append(UserHook(kind, "parameter", pname, q, w, _ops(line)))
    return out


def _ops(line: str) -> list[str]:
    return [op for op in _OPS if op in line]


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[int]:
    """The user's parameter and module backward hooks taken off (emptied in place, so autograd, which reads the
    same dicts, runs none of them), then put back in their order. Yields how many were taken off."""
    inner = unwrap(model)
    kept: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    owners: list[Any] = list(inner.modules()) + list(inner.parameters())
    try:
        for obj in owners:
            for attr in ("_backward_hooks", "_backward_pre_hooks", "_post_accumulate_grad_hooks"):
                d = getattr(obj, attr, None)
                if d:
                    user = {k: v for k, v in d.items() if not _own(v)}
                    if user:
                        kept.append((d, dict(d)))
                        for k in user:
                            del d[k]
        yield sum(len(saved) - len(d) for d, saved in kept)
    finally:
        for d, saved in kept:
            d.clear()
            d.update(saved)


class Probe:
    """Reads the gradient each user hook is handed, before the hook runs (a hook of ours put first in the same
    order: a parameter's hook dict, ``register_full_backward_hook(prepend=True)``), and writes nothing: so a
    replay can say whether the gradients were already non-finite when the user's hook received them.

    ``take()`` after a step: the parameters and modules whose incoming gradient was non-finite (one host copy)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = unwrap(model)
        self._flags: list[tuple[str, Any]] = []
        self._undo: list[Any] = []

    def attach(self) -> int:
        """Put a probe before every user hook; returns how many owners got one."""
        n = 0
        for pname, p in self.model.named_parameters():
            for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                d = getattr(p, attr, None)
                if not d or not any(not _own(v) for v in d.values()):
                    continue
                if attr == "_backward_hooks":
                    h = p.register_hook(functools.partial(_seen_grad, self._flags, pname))
                else:
                    h = p.register_post_accumulate_grad_hook(functools.partial(_seen_param, self._flags, pname))
                # first: it sees what the user's hook is handed (re-inserted, since autograd walks the plain dict's
                # order, which OrderedDict.move_to_end does not change)
                rest = [(k, v) for k, v in d.items() if k != h.id]
                ours = d[h.id]
                d.clear()
                d[h.id] = ours
                d.update(rest)
                self._undo.append(h)
                n += 1
        for mname, m in self.model.named_modules():
            name = mname or MODEL
            if any(not _own(v) for v in (getattr(m, "_backward_hooks", None) or {}).values()):
                self._undo.append(m.register_full_backward_hook(functools.partial(_seen_module, self._flags, name),
                                                                prepend=True))
                n += 1
            if any(not _own(v) for v in (getattr(m, "_backward_pre_hooks", None) or {}).values()):
                self._undo.append(m.register_full_backward_pre_hook(functools.partial(_seen_module_pre, self._flags, name),
                                                                    prepend=True))
                n += 1
        return n

    def take(self) -> list[str]:
        """Names whose incoming gradient was non-finite since the last take (in the order backward reached them)."""
        flags, self._flags[:] = list(self._flags), []
        if not flags:
            return []
        vals = torch.stack([f.to("cpu") for _, f in flags]).tolist()
        return list(dict.fromkeys(n for (n, _), v in zip(flags, vals, strict=True) if v))

    def detach(self) -> None:
        for h in self._undo:
            h.remove()
        self._undo.clear()
        self._flags.clear()


def _bad(t: Any) -> Any:
    return (~torch.isfinite(t.detach())).any()


def _seen_grad(flags: list[tuple[str, Any]], name: str, g: Any) -> None:
    if g is not None:
        flags.append((name, _bad(g)))


def _seen_param(flags: list[tuple[str, Any]], name: str, p: Any) -> None:
    if p.grad is not None:
        flags.append((name, _bad(p.grad)))


def _seen_module(flags: list[tuple[str, Any]], name: str, module: Any, grad_input: Any, grad_output: Any) -> None:
    for g in grad_input:
        if g is not None:
            flags.append((name, _bad(g)))


def _seen_module_pre(flags: list[tuple[str, Any]], name: str, module: Any, grad_output: Any) -> None:
    for g in grad_output:
        if g is not None:
            flags.append((name, _bad(g)))


__all__ = ["Probe", "describe_hook", "disabled", "found"]
