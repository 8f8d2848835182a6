"""Name the module whose autograd node raised an exception in backward.

Forward hooks remember, for the last forward, the autograd nodes of every module's inputs and
outputs. A node belongs to a module's forward when it is reachable from the module's output nodes
without passing its input nodes. When backward raises inside a custom ``torch.autograd.Function``,
the node is the ``ctx`` of its backward frame in the traceback; the innermost module whose forward
created it is the answer. Only the first forward of a step is recorded; nothing synchronises.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.records import MODEL
from ampdoctor.tensors import iter_tensors
from ampdoctor.watch.calls import call_wrapping_enabled, track_calls, unlisten_calls, uses_compile


@dataclass(frozen=True)
class BackwardBlame:
    module: str | None
    """Innermost module whose forward created the node that raised (None when not found)."""
    node: str
    """The autograd node's class name, e.g. 'MyFunctionBackward' for a custom Function."""
    custom_function: str | None
    """The custom autograd.Function's name when the node is one ('MyFunction'), else None."""


def _nodes(obj: Any) -> list[Any]:
    return [t.grad_fn for t in iter_tensors(obj) if t.grad_fn is not None]


class GraphRecorder:
    """Keeps (module, input nodes, output nodes) of every call of the model's modules: a ``CallTracker`` of the
    ``__call__`` wrapper (``watch.calls``), else forward pre/post hooks on every module."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.calls: list[tuple[str, list[Any], list[Any]]] = []
        self._open: list[list[Any]] = []
        names = {m: n or MODEL for n, m in model.named_modules()}
        self._names = {id(m): n for m, n in names.items()}
        self.handles: list[Any] = []
        self._tracking = False
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            return  # a compiled model runs its modules inside dynamo's graph: hooks there would break it
        if call_wrapping_enabled() and not uses_compile(model):  # the cheap way, nothing on the model (watch.calls)
            self._tracking = True
            track_calls(self)
            weakref.finalize(self, unlisten_calls, None)
            return
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._pre(m), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post(names[m]), with_kwargs=True))

    def enter_call(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """A call begins (``watch.calls.CallTracker``): note its input nodes when it is one of the model's."""
        if id(module) not in self._names:
            return False
        if module is self.model:
            self.calls, self._open = [], []
        self._open.append(_nodes((args, kwargs)) if torch.is_grad_enabled() else [])
        return True

    def leave_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """The call returned: keep (module, input nodes, output nodes)."""
        ins = self._open.pop() if self._open else []
        if torch.is_grad_enabled():
            self.calls.append((self._names[id(module)], ins, _nodes(output)))

    def _pre(self, module: nn.Module) -> Any:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            if module is self.model:
                self.calls, self._open = [], []
            self._open.append(_nodes((args, kwargs)) if torch.is_grad_enabled() else [])

        return hook

    def _post(self, name: str) -> Any:
        def hook(_m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            ins = self._open.pop() if self._open else []
            if torch.is_grad_enabled():
                self.calls.append((name, ins, _nodes(output)))

        return hook

    def remove(self) -> None:
        if self._tracking:
            self._tracking = False
            unlisten_calls(self)
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.calls = []

    def owner(self, node: Any) -> str | None:
        """Innermost module whose forward created ``node``."""
        owners = []
        for name, ins, outs in self.calls:
            stop = {id(n) for n in ins}
            seen: set[int] = set()
            todo = [n for n in outs if id(n) not in stop]
            while todo:
                n = todo.pop()
                if id(n) in seen:
                    continue
                seen.add(id(n))
                if n is node:
                    owners.append(name)
                    break
                todo.extend(nx for nx, _ in getattr(n, "next_functions", ()) if nx is not None and id(nx) not in stop)
        from ampdoctor.judge.locate import innermost

        inner = innermost(owners)
        return inner[0] if inner else None

    def blame(self, exc: BaseException) -> BackwardBlame | None:
        """The module behind the autograd node in whose backward ``exc`` was raised, if any."""
        node = raising_node(exc)
        if node is None:
            return None
        cls = type(node).__name__
        custom = isinstance(node, torch.autograd.function.BackwardCFunction)
        fn = cls.removesuffix("Backward") if custom else None
        return BackwardBlame(self.owner(node), cls, fn)


def raising_node(exc: BaseException) -> Any:
    """The deepest custom-Function node (its backward's ``ctx``) among the traceback's frames."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        for v in tb.tb_frame.f_locals.values():
            if isinstance(v, torch.autograd.function.BackwardCFunction):
                found = v
        tb = tb.tb_next
    return found
