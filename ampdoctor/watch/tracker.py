"""``ModuleTracker``: which of the model's modules is running as a forward goes, to name where an exception came
from (a ``watch.calls.CallTracker`` of the same ``nn.Module.__call__`` wrapper ``Hooks`` listens to, else a global
forward hook)."""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from torch import nn

from ampdoctor.records import MODEL
from ampdoctor.watch.calls import call_wrapping_enabled, remove_hooks, track_calls, unlisten_calls, uses_compile
from ampdoctor.watch.model_view import is_compiled, unwrap


class ModuleTracker:
    """Which module is running, to name where an exception came from.

    ``current`` is the innermost module whose forward has started and not finished: after an
    exception escapes the forward, the module that raised it. Like ``Hooks``, it is told of every call, held
    weakly, and keeps only the model's own modules: a ``CallTracker`` of the ``__call__`` wrapper
    (``watch.calls``), else process-wide pre/post forward hooks. Nothing is stored on the model.
    """

    def __init__(self, model: nn.Module) -> None:
        root = unwrap(model)
        self._compiled = is_compiled(model)
        """A compiled model: no hooks (dynamo would trace them), so no module is named."""
        self._wrap_call = call_wrapping_enabled() and not uses_compile(root)
        """Through the ``__call__`` wrapper (as ``Hooks``), else process-wide pre/post forward hooks."""
        self._names: dict[int, str] = {id(m): n or MODEL for n, m in root.named_modules()}
        self.stack: list[str] = []
        self._handles: list[Any] = []
        self._listening = False
        weakref.finalize(self, remove_hooks, self._handles)
        weakref.finalize(self, unlisten_calls, None)

    def attach(self) -> None:
        if self._handles or self._listening or self._compiled:
            return
        self.stack.clear()
        ref = weakref.ref(self)
        if self._wrap_call:
            self._listening = True
            track_calls(self)
            return
        self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(partial(_tracker_enter, ref)))
        self._handles.append(torch.nn.modules.module.register_module_forward_hook(partial(_tracker_leave, ref)))

    def detach(self) -> None:
        if self._listening:
            self._listening = False
            unlisten_calls(self)
        remove_hooks(self._handles)

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def enter_call(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """A call begins (``watch.calls.CallTracker``): the model's own module goes on the stack."""
        name = self._names.get(id(module))
        if name is None:
            return False
        self.stack.append(name)
        return True

    def leave_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """The call returned: off the stack."""
        if self.stack:
            self.stack.pop()


def _tracker_enter(ref: weakref.ref[ModuleTracker], module: nn.Module, *_: Any) -> None:
    t = ref()
    if t is not None and not torch.compiler.is_compiling():
        name = t._names.get(id(module))
        if name is not None:
            t.stack.append(name)


def _tracker_leave(ref: weakref.ref[ModuleTracker], module: nn.Module, *_: Any) -> None:
    # hooks must return None, or they would replace the module's output
    t = ref()
    if t is not None and not torch.compiler.is_compiling() and id(module) in t._names and t.stack:
        t.stack.pop()
