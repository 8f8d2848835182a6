"""Hooks on every module, module output and parameter of a model; records statistics only.

A step is bracketed by ``begin_step`` and ``end_step``. During it:
- forward hooks queue every module's output tensors and note which tensors were its inputs;
- a tensor hook on every recorded tensor that requires grad queues the gradient flowing back
  through it (the gradient at a module's output is the module's *incoming* gradient in backward;
  the gradient at its input is its *outgoing* gradient);
- ``after_backward`` queues every parameter's gradient (call it after ``scaler.unscale_``);
- ``after_step`` queues every parameter's value after the update.
``end_step`` reduces what is queued and copies it to the host in one transfer: the only host
synchronisation the monitor makes in a step. Hooks never synchronise.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from ampdoctor.formats import FP16, Format
from ampdoctor.records import NCOLS, Call, StepStats
from ampdoctor.tensors import iter_tensors
from ampdoctor.watch.stats import StatsBuffer


class Hooks:
    """Owns hooks on a model and turns each step into a ``StepStats``.

    Use as a context manager (hooks are removed and the model's mode restored on exit, also on
    error), or call ``attach``/``detach``.
    """

    def __init__(
        self,
        model: nn.Module,
        fmt: Format = FP16,
        *,
        activations: bool = True,
        grads: bool = True,
        params: bool = True,
        every: int = 1,
        track: bool = False,
    ) -> None:
        self.model = model
        self.fmt = fmt
        self.activations = activations
        self.grads = grads
        self.params = params
        self.every = max(1, every)
        self._handles: list[Any] = []
        self.tracker = ModuleTracker(model) if track else None
        """With ``track=True``: which module is running (names the module an exception came from)."""
        self._names = {m: n or "<model>" for n, m in model.named_modules()}
        self._param_names = [(n, p) for n, p in model.named_parameters()]
        self._active = False
        self._buf = StatsBuffer(fmt)
        self._reset(0)

    # lifecycle -----------------------------------------------------------------------------
    def attach(self) -> Hooks:
        if self._handles:
            return self
        if self.tracker is not None:
            self.tracker.attach()
        for mod in self.model.modules():
            self._handles.append(mod.register_forward_hook(self._on_forward, with_kwargs=True))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.tracker is not None:
            self.tracker.detach()
        self._active = False

    def __enter__(self) -> Hooks:
        self._training = self.model.training
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()
        self.model.train(self._training)

    # per step --------------------------------------------------------------------------------
    def _reset(self, step: int) -> None:
        self._step = step
        self._tids: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._next_tid = 0
        self._grad_enabled = True
        self._cur = StepStats(step)
        self._keys_seen = 0
        self._scalars: list[tuple[str, torch.Tensor]] = []

    def begin_step(self, step: int) -> None:
        """Start recording step ``step`` (statistics only every ``every``-th step)."""
        self._reset(step)
        self._active = step % self.every == 0
        if self.tracker is not None:
            self.tracker.stack.clear()

    @property
    def recording(self) -> bool:
        return self._active

    def _tid(self, t: torch.Tensor) -> int:
        key = id(t)
        hit = self._tids.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        tid = self._next_tid  # not len(_tids): a dead tensor's id can be reused and overwrite its entry
        self._next_tid += 1
        self._tids[key] = (weakref.ref(t), tid)
        if self.activations:
            self._buf.add(("act", tid), t)
        if self.grads and t.requires_grad and self._grad_enabled:
            t.register_hook(partial(self._on_grad, tid))
        return tid

    def _on_grad(self, tid: int, g: torch.Tensor) -> None:
        if self._active and g is not None:
            self._cur.grad_order.append(tid)
            self._buf.add(("grad", tid), g)

    def _tids_of(self, obj: Any) -> list[int]:
        # fast paths for the common shapes: one tensor, or a tuple of tensors
        if type(obj) is torch.Tensor:
            return [self._tid(obj)] if obj.is_floating_point() else []
        if type(obj) is tuple and all(type(t) is torch.Tensor for t in obj):
            return [self._tid(t) for t in obj if t.is_floating_point()]
        return [self._tid(t) for t in iter_tensors(obj) if t.is_floating_point()]

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._active:
            return
        self._grad_enabled = torch.is_grad_enabled()
        ins = self._tids_of(args if not kwargs else (args, kwargs))
        outs = self._tids_of(output)
        name = self._names.get(module, type(module).__name__)
        self._cur.calls.append(Call(name, ins, outs))
        if module is self.model:
            self._cur.model_inputs = ins
            self._cur.model_outputs = outs

    def add_scalar(self, name: str, value: torch.Tensor | float) -> None:
        """Queue a scalar (a 0-d tensor stays on the device) to come back with this step's copy."""
        if isinstance(value, torch.Tensor):
            self._scalars.append((name, value.detach().reshape(()).to(torch.float64)))
        else:
            self._cur.extra[name] = float(value)

    def after_backward(self) -> None:
        """Queue parameter gradients (after ``scaler.unscale_`` when a scaler is used)."""
        if not (self._active and self.grads):
            return
        for n, p in self._param_names:
            if p.grad is not None:
                self._buf.add(("pgrad", n), p.grad)

    def after_step(self) -> None:
        """Queue parameter values after the optimizer update."""
        if not (self._active and self.params):
            return
        for n, p in self._param_names:
            self._buf.add(("param", n), p)

    def end_step(self) -> StepStats:
        """Reduce everything queued this step and bring it to the host (one transfer)."""
        st = self._cur
        keys, rows = self._buf.collect()
        if self._scalars:
            sc = torch.stack([v.to(rows.device) for _, v in self._scalars])
            host = torch.cat([rows, _scalar_rows(sc, rows.device, rows.shape[1] or NCOLS)]).cpu().numpy()
            nsc = len(self._scalars)
            flat = host[len(keys):].reshape(-1)[:nsc]
            for (name, _), v in zip(self._scalars, flat, strict=True):
                st.extra[name] = float(v)
            host = host[: len(keys)]
        else:
            host = rows.cpu().numpy()
        for key, row in zip(keys, host, strict=True):
            kind, ident = cast(tuple[str, Any], key)
            if kind == "act":
                st.act[ident] = row
            elif kind == "grad":
                st.grad[ident] = row
            elif kind == "pgrad":
                st.pgrad[ident] = row
            elif kind == "param":
                st.param[ident] = row
        self._tids = {}
        return st


def _scalar_rows(values: torch.Tensor, device: torch.device, width: int = NCOLS) -> torch.Tensor:
    """Pack scalars into whole stats-width rows so they travel in the same copy."""
    n = values.numel()
    nrows = -(-n // width)
    out = torch.zeros(nrows * width, dtype=torch.float64, device=device)
    out[:n] = values
    return out.view(nrows, width)


class ModuleTracker:
    """Forward pre/post hooks that know which module is running, to name where an error came from.

    ``current`` is the innermost module whose forward has started and not finished: after an
    exception escapes the forward, the module that raised it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack: list[str] = []
        self._handles: list[Any] = []

    def attach(self) -> None:
        if self._handles:
            return
        self.stack.clear()
        for n, m in self.model.named_modules():
            self._handles.append(m.register_forward_pre_hook(partial(_enter, self.stack, n or "<model>")))
            self._handles.append(m.register_forward_hook(partial(_leave, self.stack)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None


def _enter(stack: list[str], name: str, *_: Any) -> None:
    stack.append(name)


def _leave(stack: list[str], *_: Any) -> None:
    # hooks must return None, or they would replace the module's output
    if stack:
        stack.pop()
