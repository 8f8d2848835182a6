"""The process-wide watch on module calls: one wrapper of ``nn.Module.__call__`` and the objects it tells.

While anything listens, ``nn.Module.__call__`` is replaced by ``_recording_call`` (one Python frame around
torch's own, which keeps its fast path for modules with no hooks) instead of a global forward hook, which
sends every module call through ``_call_impl``'s slow path: about 4 µs a call, which on a model of many
small modules was most of what watching cost (docs/performance.md). The wrapper is in place only while
someone listens and is taken away with the last. Every listener is held weakly: an unclosed one (a
notebook cell run twice) keeps nothing alive, and its place goes with it.

Two kinds of object listen, each a ``Protocol`` below:

- a ``CallListener`` (``watch.hooks.Hooks``, ``watch.tap.ForwardTap``) is told after each call
  (``after_call``); one that raises is stopped and handed the error (``on_error``): never the user's forward;
- a ``CallTracker`` (``watch.tracker.ModuleTracker``, ``watch.blame.GraphRecorder``, ``ForwardTap`` for the
  start of a training call) is told as each call begins (``enter_call``) and, when that returned True, as it
  ends (``leave_call``). An exception in the call skips ``leave_call``: what was entered stays (the module
  it came from).

Where a module of the model is compiled, or with ``AMPDOCTOR_MODULE_HOOK=global``, the listeners use a
process-wide forward hook instead (``call_wrapping_enabled``, ``uses_compile``; ``remove_hooks`` takes it
away). Under dynamo the wrapper does nothing: traced as a no-op, the compiled graph holds no trace of it.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol, overload, runtime_checkable

import torch
from torch import nn

FastCall = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], bool]
"""A native listener's own call, ``fast(module, args, kwargs, output)`` (the C++ recorder's ``tap_call``): it
holds no reference to its listener and returns whether to call the listener's ``take_acts()``."""


@runtime_checkable
class CallListener(Protocol):
    """Told after every module call while it listens (``listen_calls``)."""

    on_error: Callable[[BaseException], None] | None
    """Called once with what ``after_call`` raised (the listener has been stopped by then)."""

    def after_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """A module call returned ``output`` (any module of the process: filter to your own)."""


@runtime_checkable
class NativeListener(CallListener, Protocol):
    """A listener whose calls a ``FastCall`` takes (``listen_calls(h, fast)``)."""

    def take_acts(self) -> None:
        """Take what the ``FastCall`` queued (called when it returned True)."""


@runtime_checkable
class CallTracker(Protocol):
    """Told around every module call while it listens (``track_calls``)."""

    def enter_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A module call begins; return True to be told ``leave_call`` when it returns."""

    def leave_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """A call ``enter_call`` returned True for has returned ``output``."""


_LISTENERS: list[tuple[weakref.ref[Any], FastCall | None]] = []
_TRACKERS: list[weakref.ref[CallTracker]] = []
_ORIG_CALL: Any = nn.Module.__call__


def _tracked_call(self: nn.Module, args: tuple, kwargs: dict) -> Any:
    """A call while a tracker listens: ``enter_call`` before it, ``leave_call`` after it for those that asked."""
    entered = []
    if not torch.compiler.is_compiling():
        for ref in _TRACKERS:
            t = ref()
            if t is not None and t.enter_call(self, args, kwargs):
                entered.append(t)
    out = _ORIG_CALL(self, *args, **kwargs)
    for t in entered:
        t.leave_call(self, args, kwargs, out)
    return out


_is_compiling = torch.compiler.is_compiling
"""(the same function: dynamo knows it by identity and traces it as True)"""


def _recording_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    out = _ORIG_CALL(self, *args, **kwargs) if not _TRACKERS else _tracked_call(self, args, kwargs)
    if _is_compiling():  # traced by dynamo: nothing of ours goes into the graph
        return out
    for ref, fast in _LISTENERS:
        try:
            if fast is not None:  # the C++ recorder, called directly (it filters modules and steps itself)
                if fast(self, args, kwargs, out):
                    h = ref()
                    if h is not None:
                        h.take_acts()
                continue
            h = ref()
            if h is not None:
                h.after_call(self, args, kwargs, out)
        except Exception as e:  # never in the user's forward: the listener goes, its owner is told
            listener_failed(ref(), e)
    return out


def listener_failed(h: CallListener | None, exc: BaseException) -> None:
    """A listener raised inside the user's forward or backward: stop it listening and hand the error to its
    ``on_error``."""
    if h is None:
        return
    try:
        unlisten_calls(h)
        cb = h.on_error
        if cb is not None:
            cb(exc)
    except Exception:  # pragma: no cover - reporting must not raise either
        pass


@overload
def listen_calls(h: CallListener) -> None: ...
@overload
def listen_calls(h: NativeListener, fast: FastCall | None) -> None: ...
def listen_calls(h: Any, fast: FastCall | None = None) -> None:
    """Have ``h.after_call(module, args, kwargs, output)`` called after every module call (``h`` held weakly), or
    ``fast(module, args, kwargs, output)``, which holds no reference to ``h`` and returns whether to call
    ``h.take_acts()``."""
    unlisten_calls(h)
    _LISTENERS.append((weakref.ref(h), fast))
    _wrap()


def track_calls(t: CallTracker) -> None:
    """Have ``t.enter_call`` and ``t.leave_call`` called around every module call (``t`` held weakly)."""
    _TRACKERS.append(weakref.ref(t))
    _wrap()


def _wrap() -> None:
    global _ORIG_CALL
    if nn.Module.__call__ is not _recording_call:
        _ORIG_CALL = nn.Module.__call__
        nn.Module.__call__ = _recording_call  # type: ignore[method-assign]


def unlisten_calls(h: object | None) -> None:
    """Stop ``h`` listening and tracking (None: only drop dead ones); unwrap ``__call__`` when nobody listens."""
    _LISTENERS[:] = [(r, f) for r, f in _LISTENERS if r() is not None and r() is not h]
    _TRACKERS[:] = [r for r in _TRACKERS if r() is not None and r() is not h]
    if not _LISTENERS and not _TRACKERS and nn.Module.__call__ is _recording_call:  # (wrapped again by someone
        nn.Module.__call__ = _ORIG_CALL  # type: ignore[method-assign]  # else: left to them)


def watchers() -> int:
    """How many objects watch module calls now: the ``__call__`` wrapper's live listeners and trackers plus global
    forward hooks (0 means nothing of ampdoctor's is in any module call)."""
    live = sum(1 for r, _ in _LISTENERS if r() is not None) + sum(1 for r in _TRACKERS if r() is not None)
    return live + len(torch.nn.modules.module._global_forward_hooks) + (
        1 if not live and nn.Module.__call__ is _recording_call else 0)


def is_wrapped() -> bool:
    """Whether ``nn.Module.__call__`` is ampdoctor's wrapper now."""
    return nn.Module.__call__ is _recording_call


def uses_compile(root: nn.Module) -> bool:
    """Whether any module of ``root`` runs compiled (``torch.compile(sub)`` inside, or ``sub.compile()``)."""
    # _modules, not getattr: a missing attribute goes through nn.Module.__getattr__ and an exception, per module
    return any(isinstance(m._modules.get("_orig_mod"), nn.Module) or getattr(m, "_compiled_call_impl", None) is not None
               for m in root.modules())


def call_wrapping_enabled() -> bool:
    """Whether module calls are watched through the ``__call__`` wrapper (``AMPDOCTOR_MODULE_HOOK=global``: a
    global forward hook instead, the slower way torch offers, kept as a fallback)."""
    return os.environ.get("AMPDOCTOR_MODULE_HOOK", "call") != "global"


def remove_hooks(handles: list[Any]) -> None:
    """Remove process-wide module hooks (and the flag torch leaves behind for a with_kwargs one)."""
    kw = getattr(torch.nn.modules.module, "_global_forward_hooks_with_kwargs", {})
    for h in handles:
        h.remove()
        # torch (2.13) leaves a with_kwargs global hook's flag behind on remove, and while any flag is
        # there torch.compile'd modules warn about global hooks: take it away with the hook
        kw.pop(h.id, None)
    handles.clear()


__all__ = ["CallListener", "CallTracker", "FastCall", "NativeListener", "call_wrapping_enabled", "is_wrapped",
           "listen_calls", "listener_failed", "remove_hooks", "track_calls", "unlisten_calls", "uses_compile", "watchers"]
