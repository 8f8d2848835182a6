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

Nothing is stored on the model. The forward hook is one process-wide module hook
(``torch.nn.modules.module.register_module_forward_hook``), filtered to the watched model's
modules, and registered only while a step is being recorded: steps that are not recorded run
with no hook at all, and ``torch.save(model)`` never pickles an ampdoctor object. The global hook
holds the ``Hooks`` weakly, so an unclosed monitor (a notebook cell run twice) does not keep the
model alive; its hook goes away with it.

A ``torch.compile``d model is watched through its original module (``_orig_mod``) without the
forward hook: its modules run inside dynamo's graph, where a hook could only break the graph, so
its parameter gradients and values are recorded and its activations are not. (Should the hook
meet a compiled region anyway, it does nothing there: dynamo traces it as a no-op.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from ampdoctor.formats import FP16, Format
from ampdoctor.records import NCOLS, Call, StepStats
from ampdoctor.tensors import iter_tensors
from ampdoctor.watch import fused
from ampdoctor.watch.stats import StatsBuffer

_WRAPPERS = ("DistributedDataParallel", "DataParallel")


def unwrap(model: nn.Module) -> nn.Module:
    """The module a wrapper runs: a ``torch.compile``d model's ``_orig_mod``, a ``DistributedDataParallel``
    or ``DataParallel``'s ``module`` (in any nesting), else the model itself. Names are the inner
    module's, so a rank's log and capture read like a single-process run."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module) and type(model).__name__ in _WRAPPERS:
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _is_compiled(model: nn.Module) -> bool:
    """Whether a ``torch.compile``d module is anywhere in the wrapping (DDP around compiled, or the reverse)."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            return True
        inner = getattr(model, "module", None) if type(model).__name__ in _WRAPPERS else None
        if not isinstance(inner, nn.Module):
            return False
        model = inner


def _training(ref: weakref.ref[nn.Module]) -> bool:
    m = ref()
    return m is not None and m.training


def _global_hook(ref: weakref.ref[Hooks]) -> Callable[[nn.Module, tuple, dict, Any], None]:
    """The process-wide forward hook of one ``Hooks``: holds it weakly, does nothing under dynamo."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if torch.compiler.is_compiling():  # traced as a constant: the compiled graph holds no trace of us
            return
        h = ref()
        if h is not None:
            h._on_forward(module, args, kwargs, output)

    return hook


def _drain(ref: weakref.ref[Hooks]) -> None:
    """The gradient tap's callback when its queue is full (called from backward, with the GIL)."""
    h = ref()
    if h is not None:
        h._take_grads()


def remove_hooks(handles: list[Any]) -> None:
    """Remove process-wide module hooks (and the flag torch leaves behind for a with_kwargs one)."""
    kw = getattr(torch.nn.modules.module, "_global_forward_hooks_with_kwargs", {})
    for h in handles:
        h.remove()
        # torch (2.13) leaves a with_kwargs global hook's flag behind on remove, and while any flag is
        # there torch.compile'd modules warn about global hooks: take it away with the hook
        kw.pop(h.id, None)
    handles.clear()


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
        self._attached = False
        root = unwrap(model)
        self._compiled = _is_compiled(model)
        """A compiled model runs its modules inside dynamo's graph: no forward hook (see the module doc)."""
        self.training_only = False
        """Record only training forwards (the root in train mode, grad enabled): the framework callbacks set
        it, so an evaluation run in the middle of training stays out of the next step's statistics."""
        self._root = weakref.ref(root)
        self._root_id = id(root)
        # keyed by id: no reference to the modules from here (the model owns them; while it lives ids are unique)
        self._names: dict[int, str] = {id(m): n or "<model>" for n, m in root.named_modules()}
        self._param_names = [(n, p) for n, p in root.named_parameters()]
        self._active = False
        self.record_if: Callable[[int], bool] | None = None
        """Decides which steps ``begin_step`` records (the monitor's sentinel mode sets it)."""
        weakref.finalize(self, remove_hooks, self._handles)  # an unclosed Hooks takes its global hook with it
        self._buf = StatsBuffer(fmt)
        self._serial = 0
        """Counts recorded steps: a gradient hook left from another step (a tensor kept across steps) does nothing."""
        self._tap: Any = None
        """The C++ gradient tap (``fused``), when the kernel is built: a gradient hook that queues the gradient
        with no Python call in backward. Without it, a Python tensor hook per watched tensor does the same."""
        mod = fused.kernel()
        if mod is not None and grads:
            self._tap = mod.GradTap(self._buf.flush_numel, partial(_drain, weakref.ref(self)))
            self._tap_watch = mod.tap_watch
            self._tap_take = mod.tap_take
            self._tap_start = mod.tap_start
        self.exchanged: Any = None
        """The host copy of the last ``end_step``'s ``exchange`` result (a numpy vector), else None."""
        self._reset(0)

    # lifecycle -----------------------------------------------------------------------------
    def attach(self) -> Hooks:
        self._attached = True
        self._sync_hook()
        if self.tracker is not None:
            self.tracker.attach()
        return self

    def detach(self) -> None:
        self._attached = False
        self._active = False
        self._sync_hook()
        if self.tracker is not None:
            self.tracker.detach()

    def _sync_hook(self) -> None:
        """The global forward hook is registered exactly while attached and recording."""
        want = self._attached and self._active and not self._compiled
        if want and not self._handles:
            hook = _global_hook(weakref.ref(self))
            self._handles.append(torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True))
        elif not want and self._handles:
            remove_hooks(self._handles)

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
        self._vector: tuple[tuple[str, ...], torch.Tensor] | None = None

    def begin_step(self, step: int, record: bool | None = None) -> None:
        """Start step ``step``: recorded when ``record`` says so, else when ``record_if(step)`` does
        (when set), else every ``every``-th step. A step not recorded runs with no hook at all."""
        self._reset(step)
        if self.tracker is not None:
            self.tracker.stack.clear()
        if record is None:
            record = self.record_if(step) if self.record_if is not None else step % self.every == 0
        self._active = record
        self._serial += 1
        if self._tap is not None:
            self._tap_start(self._tap, self._serial, record)
        self._sync_hook()

    @property
    def recording(self) -> bool:
        return self._active

    @property
    def current(self) -> StepStats:
        """The step being recorded (its calls and gradient order are on the host; rows come at ``end_step``)."""
        return self._cur

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
            if self._tap is not None:
                self._tap_watch(self._tap, t, tid)
            else:
                t.register_hook(partial(self._on_grad, self._serial, tid))
        return tid

    def _on_grad(self, serial: int, tid: int, g: torch.Tensor) -> None:
        if self._active and serial == self._serial and g is not None:
            self._cur.grad_order.append(tid)
            self._buf.add(("grad", tid), g)

    def _take_grads(self) -> None:
        """Move the gradients the C++ tap queued (in arrival order) into this step's record."""
        if self._tap is None:
            return
        tids, grads = self._tap_take(self._tap)
        if tids:
            self._cur.grad_order.extend(tids)
            add = self._buf.add
            for tid, g in zip(tids, grads, strict=True):
                add(("grad", tid), g)

    def _tids_of(self, obj: Any) -> list[int]:
        # fast paths for the common shapes: one tensor, or a tuple of tensors
        if type(obj) is torch.Tensor:
            return [self._tid(obj)] if obj.is_floating_point() else []
        if type(obj) is tuple and all(type(t) is torch.Tensor for t in obj):
            return [self._tid(t) for t in obj if t.is_floating_point()]
        return [self._tid(t) for t in iter_tensors(obj) if t.is_floating_point()]

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = self._names.get(id(module))
        if name is None or not self._active:  # another model's module (the hook is process-wide)
            return
        if self.training_only and not (torch.is_grad_enabled() and _training(self._root)):
            return
        self._grad_enabled = torch.is_grad_enabled()
        ins = self._tids_of(args if not kwargs else (args, kwargs))
        outs = self._tids_of(output)
        self._cur.calls.append(Call(name, ins, outs))
        if id(module) == self._root_id:
            self._cur.model_inputs = ins
            self._cur.model_outputs = outs

    def add_scalar(self, name: str, value: torch.Tensor | float) -> None:
        """Queue a scalar (a 0-d tensor stays on the device) to come back with this step's copy."""
        if isinstance(value, torch.Tensor):
            self._scalars.append((name, value.detach().reshape(()).to(torch.float64)))
        else:
            self._cur.extra[name] = float(value)

    def add_scalars(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        """Queue a vector of named scalars (1-D, float64, on the device) in one go: the step recipe's own."""
        self._vector = (names, values)

    def after_backward(self) -> None:
        """Queue parameter gradients (after ``scaler.unscale_`` when a scaler is used)."""
        if not (self._active and self.grads):
            return
        self._take_grads()
        for n, p in self._param_names:
            if p.grad is not None:
                self._buf.add(("pgrad", n), p.grad)

    def after_step(self) -> None:
        """Queue parameter values after the optimizer update."""
        if not (self._active and self.params):
            return
        for n, p in self._param_names:
            self._buf.add(("param", n), p)

    def end_step(self, exchange: Callable[[list[Hashable], torch.Tensor], torch.Tensor] | None = None) -> StepStats:
        """Reduce everything queued this step and bring it to the host (one transfer).

        ``exchange(keys, rows)``: called with the reduced rows still on the device, returns a 1-D
        tensor (the ranks' all-reduce) that comes back in the same copy, as ``self.exchanged``."""
        st = self._cur
        self._take_grads()
        self._serial += 1  # a gradient arriving after the step ended belongs to no step
        if self._tap is not None:
            self._tap_start(self._tap, self._serial, False)
        keys, rows = self._buf.collect()
        extra = exchange(keys, rows).reshape(-1).to(torch.float64) if exchange is not None else None
        self.exchanged = None
        vec = self._vector
        self._vector = None
        if vec is not None:  # the recipe's vector first, then any single scalars: one list of names
            names = list(vec[0]) + [n for n, _ in self._scalars]
        else:
            names = [n for n, _ in self._scalars]
        if names or extra is not None:
            parts = [vec[1].to(rows.device)] if vec is not None else []
            if self._scalars:
                parts.append(torch.stack([v.to(rows.device) for _, v in self._scalars]))
            if extra is not None:
                parts.append(extra.to(rows.device))
            flat_d = torch.cat(parts)
            host = torch.cat([rows, _scalar_rows(flat_d, rows.device, rows.shape[1] or NCOLS)]).cpu().numpy()
            nsc = len(names)
            flat = host[len(keys):].reshape(-1)
            for name, v in zip(names, flat[:nsc], strict=True):
                st.extra[name] = float(v)
            if extra is not None:
                self.exchanged = flat[nsc: nsc + extra.numel()].copy()
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
    """Which module is running, to name where an exception came from.

    ``current`` is the innermost module whose forward has started and not finished: after an
    exception escapes the forward, the module that raised it. Like ``Hooks``, it uses process-wide
    pre/post forward hooks filtered to the model's modules, held weakly: nothing is stored on the model.
    """

    def __init__(self, model: nn.Module) -> None:
        root = unwrap(model)
        self._compiled = _is_compiled(model)
        """A compiled model: no hooks (dynamo would trace them), so no module is named."""
        self._names: dict[int, str] = {id(m): n or "<model>" for n, m in root.named_modules()}
        self.stack: list[str] = []
        self._handles: list[Any] = []
        weakref.finalize(self, remove_hooks, self._handles)

    def attach(self) -> None:
        if self._handles or self._compiled:
            return
        self.stack.clear()
        ref = weakref.ref(self)
        self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(partial(_tracker_enter, ref)))
        self._handles.append(torch.nn.modules.module.register_module_forward_hook(partial(_tracker_leave, ref)))

    def detach(self) -> None:
        remove_hooks(self._handles)

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None


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
