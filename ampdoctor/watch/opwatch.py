"""The ops inside a module, in the user's own training forward: each op's largest |x| where the op's output is in
the run's reduced format, for the forecast (``engine.growth``).

Module hooks see what a module returns; an attention module's raw ``q @ k^T`` grows inside it while its output, a
softmax-weighted mean of ``v``, stays small. ``OpWatch`` is a ``CallTracker`` (``watch.calls``): on a step the hooks
record, while the watched model's forward runs, a ``TorchFunctionMode`` sees each torch function the model calls and
queues, on the device, the largest and the smallest value of its floating output where that output is in the
format's dtype (FP16 under FP16 autocast: an FP32 op cannot pass 65504). A module's own output is the module's
figure already and is left out; so are views and casts (their values are their input's). Per (innermost module,
op, its ordinal among that module's ops of that name) the values are reduced over the step's calls of the module
and queued with ``Hooks.add_scalar``: they come back in the step's one host copy (``StepStats.extra`` under
``op:<module> > <op>``). Nothing is written to a tensor of the run: the figures are new tensors made under
``no_grad``; the op itself is called as it would be. Torch functions inside a function (``F.multi_head_attention_forward``,
``scaled_dot_product_attention``) are one op: their inner products are not seen.

It also notes which modules return a tensor in the format's dtype (``reduced``): the gradient at such an output, and
its parameters' gradients, are computed in that format (``engine.growth`` forecasts those only).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ampdoctor.records import MODEL
from ampdoctor.tensors import iter_tensors
from ampdoctor.watch.calls import track_calls, unlisten_calls

PREFIX = "op:"
"""The ``StepStats.extra`` names of the op figures: ``op:<module> > <op>``."""

SAME_VALUES = frozenset({
    "view", "reshape", "transpose", "permute", "unbind", "chunk", "split", "split_with_sizes", "contiguous", "flatten",
    "unflatten", "unsqueeze", "squeeze", "expand", "expand_as", "view_as", "t", "T", "mT", "mH", "H", "narrow",
    "select", "__getitem__", "to", "float", "half", "bfloat16", "double", "type", "type_as", "clone", "detach",
    "repeat", "repeat_interleave", "tile", "cat", "stack", "movedim", "swapaxes", "swapdims", "roll", "flip",
    "__get__", "__set__", "size", "dim", "numel", "__len__", "data_ptr", "dtype", "shape", "device", "requires_grad_",
    "masked_fill", "masked_fill_", "dropout", "tensor_split", "index_select", "gather", "where", "ne", "eq",
    "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "triu", "tril",
})
"""Ops whose output holds values of their inputs (views, copies, casts, selections, fills): no new magnitude."""


class _Mode(TorchFunctionMode):
    def __init__(self, watch: OpWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        w = self.watch
        if w.on:
            name = getattr(func, "__name__", "")
            if name not in SAME_VALUES:
                try:
                    w.seen(name.strip("_"), out)
                except Exception:  # never in the user's forward: the watch stops, the figures of this step are dropped
                    w.fail()
        return out


LEARN = 4
"""Without reading the ops, the recorded forwards that say which modules return the format's dtype."""


class OpWatch:
    """``OpWatch(model, hooks)``: figures of the ops inside ``model``'s modules on the steps ``hooks`` records.

    ``attach()`` starts watching module calls; ``detach()`` stops (the Monitor's hooks call both: ``Hooks.tracker``). The dtype watched is the format's
    (``torch.float16`` for FP16, ``torch.bfloat16`` for BF16)."""

    def __init__(self, model: nn.Module, hooks: Any, dtype: torch.dtype, read_ops: bool = True) -> None:
        self.read_ops = read_ops
        self.learned = 0
        """Forwards read; without ``read_ops`` the first ``LEARN`` say which modules return the format's dtype, and
        the module calls are not watched after them (the cost of a call per module on a model of many)."""
        """Read each op's output (the mode); without it only which modules return the format's dtype (``reduced``:
        the gradient series' modules), from the module calls the hooks' tracker sees anyway."""
        self.hooks = hooks
        self.dtype = dtype
        names = getattr(hooks, "_names", None)
        self._names: dict[int, str] = dict(names) if isinstance(names, dict) else \
            {id(m): n or MODEL for n, m in model.named_modules()}
        """id(module) -> its name, as the hooks name it (the ring's and the report's names)."""
        self._root = weakref.ref(model)
        self._root_id = id(model)
        self._mode: _Mode | None = None
        self.on = False
        """The mode records (inside a recorded training forward of the model)."""
        self._tracking = False
        self._attached = False
        self._hooks_listening = bool(getattr(hooks, "_listening", False))
        self.stack: list[tuple[str, dict[str, int], list[tuple[str, int, torch.Tensor]]]] = []
        """Per module call in progress: (name, ops counted per op name, [(key, id of the op's output, figure)])."""
        self._acc: dict[str, torch.Tensor] = {}
        """The step's figures so far: key -> largest |x| (a 0-d tensor on the device)."""
        self.reduced: set[str] = set()
        """Modules seen returning a tensor in the format's dtype."""
        self.failed = False
        self.sample = True
        """Read the ops in the next recorded forward (``engine.growth`` samples the steps)."""

    def attach(self) -> None:
        """Watch module calls (the hooks' ``tracker``: attached and detached with them, and listening only while
        they listen: ``sync``)."""
        self._attached = True
        self._apply()

    def detach(self) -> None:
        self._attached = False
        self.stack.clear()
        self._stop_mode()
        self._apply()

    def sync(self, listening: bool) -> None:
        """The hooks started or stopped watching module calls (``Hooks._sync_hook``): a sentinel or unrecorded step
        has no watcher on module calls, this one neither."""
        self._hooks_listening = listening
        self._apply()

    def _apply(self) -> None:
        done = not self.read_ops and self.learned >= LEARN  # (which modules return FP16 is known)
        want = self._attached and self._hooks_listening and not self.failed and not done
        if want and not self._tracking:
            self._tracking = True
            track_calls(self)
        elif not want and self._tracking:
            self._tracking = False
            unlisten_calls(self)

    def fail(self) -> None:
        self.failed = True
        self.on = False
        self._acc.clear()

    # -- the CallTracker ---------------------------------------------------------------------------------------------
    def enter_call(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        name = self._names.get(id(module))
        if name is None or self.failed:
            return False
        if id(module) == self._root_id and not self.stack:
            if not (self.sample and self.hooks.recording and torch.is_grad_enabled() and module.training):
                return False
            if not self.read_ops and self.learned >= LEARN:
                return False
            self.learned += 1
            self._start_mode()
        elif not self.on:
            return False
        self.stack.append((name, {}, []))
        return True

    def leave_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.stack:
            return
        name, _, ops = self.stack.pop()
        try:
            outs = [t for t in iter_tensors(output) if t.is_floating_point()]
            if any(t.dtype == self.dtype for t in outs):
                self.reduced.add(name)
            own = {id(t) for t in outs}
            acc = self._acc
            for key, tid, fig in ops:
                if tid in own:
                    continue  # the module's own output: its figure is the module's
                prev = acc.get(key)
                acc[key] = fig if prev is None else torch.maximum(prev, fig)
        except Exception:
            self.fail()
        if not self.stack:  # the root's call ended: the step's figures go into its one host copy
            self._stop_mode()
            self._queue()

    # -- the mode ----------------------------------------------------------------------------------------------------
    def seen(self, op: str, out: Any) -> None:
        if not self.stack:
            return
        name, counts, ops = self.stack[-1]
        for t in iter_tensors(out):
            if type(t) is not torch.Tensor or t.dtype != self.dtype or t.numel() == 0:
                continue
            k = counts.get(op, 0)
            counts[op] = k + 1
            with torch.no_grad():
                d = t.detach()
                fig = torch.maximum(d.amax(), d.amin().neg()).float()
            ops.append((f"{name} > {op}" + (f" #{k + 1}" if k else ""), id(t), fig))

    def _start_mode(self) -> None:
        if self.read_ops:
            self._mode = _Mode(self)
            self._mode.__enter__()
        self.on = True

    def _stop_mode(self) -> None:
        self.on = False
        mode, self._mode = self._mode, None
        if mode is None:
            return
        try:
            mode.__exit__(None, None, None)
        except Exception:  # (a mode the user pushed after ours and left on: ours stays, switched off)
            pass

    def _queue(self) -> None:
        acc, self._acc = self._acc, {}
        if self.failed or not acc or not self.hooks.recording:
            return
        for key, fig in acc.items():
            self.hooks.add_scalar(PREFIX + key, fig)

    def end_step(self) -> None:
        """After the step: a forward that raised left its call stack and maybe the mode on; both go."""
        if self.stack or self._mode is not None:
            self.stack.clear()
            self._stop_mode()
            self._acc.clear()


def op_figures(extra: dict[str, float]) -> dict[str, float]:
    """The op figures of a step (``StepStats.extra``): ``<module> > <op>`` -> largest |x|."""
    return {k[len(PREFIX):]: v for k, v in extra.items() if k.startswith(PREFIX)}


__all__ = ["PREFIX", "SAME_VALUES", "OpWatch", "op_figures"]
