"""Hooks on every module, module output and parameter of a model; records statistics only.

A step is bracketed by ``begin_step`` and ``end_step``. During it:
- every call of a watched module notes which tensors were its inputs and outputs, and each new
  floating tensor is queued for statistics;
- every recorded tensor that requires grad gets a gradient hook that queues the gradient flowing
  back through it (the gradient at a module's output is the module's *incoming* gradient in
  backward; the gradient at its input is its *outgoing* gradient);
- ``after_backward`` queues every parameter's gradient (call it after ``scaler.unscale_``);
- ``after_step`` queues every parameter's value after the update.
``end_step`` reduces what is queued and copies it to the host in one transfer: the only host
synchronisation the monitor makes in a step. Hooks never synchronise.

Two recorders give the same records (tests/test_hooks_native.py): the C++ one in ``watch.fused``
(``Tap``: tensor ids, calls, gradient hooks in C++, rows of CPU tensors made as each tensor appears,
no Python call in backward), used once the kernel is built, and the Python code here until then or
without a compiler.

Nothing is stored on the model. Module calls are seen by wrapping ``nn.Module.__call__`` while a
step is recorded (``watch.calls``: ``Hooks`` is a ``NativeListener`` of it, ``ModuleTracker`` a
``CallTracker``; one frame around torch's own, which keeps its fast path for modules without
hooks; a global forward hook sends every call through ``_call_impl``'s slow path, about 4 µs a
call). Where a module of the model is compiled, or with ``AMPDOCTOR_MODULE_HOOK=global``, a
process-wide forward hook (``register_module_forward_hook``) is used instead. Either is filtered
to the watched model's modules and in place only while a step is recorded: steps that are not
recorded run with nothing of ours at all, and ``torch.save(model)`` never pickles an ampdoctor
object. Both hold the ``Hooks`` weakly, so an unclosed monitor (a notebook cell run twice) does
not keep the model alive; its watch goes away with it.

A ``torch.compile``d model is watched through its original module (``_orig_mod``) without
watching its calls: its modules run inside dynamo's graph, where a hook could only break the
graph, so its parameter gradients and values are recorded and its activations are not. (Should
the wrapper or the hook meet a compiled region anyway, it does nothing there: dynamo traces it as
a no-op.)
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from ampdoctor.formats import FP16, Format
from ampdoctor.records import MODEL, NCOLS, Call, StepStats
from ampdoctor.tensors import iter_tensors
from ampdoctor.watch import fused
from ampdoctor.watch.calls import (
    call_wrapping_enabled,
    listen_calls,
    listener_failed,
    remove_hooks,
    unlisten_calls,
    uses_compile,
)
from ampdoctor.watch.model_view import is_compiled, local, named_modules, named_parameters, unwrap
from ampdoctor.watch.stats import StatsBuffer, _thresholds, scaled_stats
from ampdoctor.watch.tracker import ModuleTracker


def _plain(obj: Any) -> Any:
    """A module call's tensors as plain ones, for the recorders: a tensor parallel layer's output is an
    ``AsyncCollectiveTensor`` (its all-reduce still in flight: waited for here, which it would be at its first
    use anyway) or a DTensor (its local shard); tuples, lists and dicts are looked into."""
    t = type(obj)
    if t is torch.Tensor:
        return obj
    if t.__name__ == "AsyncCollectiveTensor" and hasattr(obj, "trigger_wait"):
        return obj.trigger_wait()
    if t.__name__ == "DTensor" and hasattr(obj, "_local_tensor"):
        return obj._local_tensor
    if t is tuple or t is list:
        return t(_plain(x) for x in obj)
    if t is dict:
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _plain_call(fast: Callable[..., bool], module: nn.Module, args: tuple, kwargs: dict, output: Any) -> bool:
    return fast(module, _plain(args), _plain(kwargs), _plain(output))


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
            try:
                h.after_call(module, args, kwargs, output)
            except Exception as e:  # never in the user's forward
                h._active = False
                listener_failed(h, e)

    return hook


def _drain(ref: weakref.ref[Hooks]) -> None:
    """The gradient tap's callback when its queue is full (called from backward, with the GIL)."""
    h = ref()
    if h is not None:
        h._take_grads()


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
        self._compiled = is_compiled(model)
        """A compiled model runs its modules inside dynamo's graph: no forward hook (see the module doc)."""
        self._training_only = False
        self._root = weakref.ref(root)
        self._root_id = id(root)
        # keyed by id: no reference to the modules from here (the model owns them; while it lives ids are unique)
        self._names: dict[int, str] = {id(m): n or MODEL for n, m in named_modules(root)}
        self._param_names = named_parameters(root)
        self._pgrad_keys: list[tuple[Hashable, torch.Tensor]] = [(("pgrad", n), p) for n, p in self._param_names]
        self._param_keys: list[Hashable] = [("param", n) for n, _ in self._param_names]
        self._pgrad_list: list[Hashable] = [k for k, _ in self._pgrad_keys]
        self._params: list[torch.Tensor] = [p for _, p in self._param_names]
        self._sharded = any(local(p) is not p for p in self._params)
        """DTensor parameters: statistics read each one's local shard."""
        self._param_numel = sum(local(p).numel() for p in self._params)
        self._split: tuple[torch.device, bool] | None = None
        """Whether the parameters are on more than one device, and the first one's device when that was seen."""
        self._same: tuple[list[Any], bool] | None = None
        """A caller's parameter list, and whether it is this model's parameters in order (``grads_with_norms``)."""
        self._active = False
        self.on_error: Callable[[BaseException], None] | None = None
        """Called once when recording raised inside the user's forward or backward (the hooks stop recording);
        the monitor turns itself off with one warning."""
        self.record_if: Callable[[int], bool] | None = None
        """Decides which steps ``begin_step`` records (the monitor's sentinel mode sets it)."""
        self._listening = False
        self._configured = False
        """Whether the C++ recorder knows the modules and ``training_only`` (told once, again when it changes)."""
        self._wrap_call = True
        weakref.finalize(self, remove_hooks, self._handles)  # an unclosed Hooks takes its global hook with it
        weakref.finalize(self, unlisten_calls, None)  # and its place among the __call__ wrapper's listeners
        self._buf = StatsBuffer(fmt)
        self._serial = 0
        """Counts recorded steps: a gradient hook left from another step (a tensor kept across steps) does nothing."""
        self._mods = list(self._names.values())
        self._index = {k: i for i, k in enumerate(self._names)}
        self._root_index = self._index[id(root)]
        self._native: Any = None
        """The C++ recorder (``fused``'s ``Tap``) once the kernel is built: module calls, tensor ids and gradient
        hooks in C++, with no Python call in backward. Until then (or without a compiler) the Python code here
        does the same, and the records are the same (tests/test_hooks_native.py)."""
        self._tap: Any = None
        self._key_cache: dict[str, tuple[list[int], list[Hashable]]] = {}
        self.exchanged: Any = None
        """The host copy of the last ``end_step``'s ``exchange`` result (a numpy vector), else None."""
        self._reset(0)

    # lifecycle -----------------------------------------------------------------------------
    def attach(self) -> Hooks:
        self._attached = True
        root = self._root()
        self._wrap_call = call_wrapping_enabled() and root is not None and not uses_compile(root)
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

    @property
    def training_only(self) -> bool:
        """Record only training forwards (the root in train mode, grad enabled): the framework callbacks set
        it, so an evaluation run in the middle of training stays out of the next step's statistics."""
        return self._training_only

    @training_only.setter
    def training_only(self, value: bool) -> None:
        self._training_only = value
        self._configured = False
        if self._listening:  # the C++ recorder checks it itself: listen again with the new setting
            self._listening = False
            unlisten_calls(self)
            remove_hooks(self._handles)
            self._sync_hook()

    def _sync_hook(self) -> None:
        """Module calls are watched exactly while attached and recording: through the ``__call__`` wrapper,
        or, where a module of the model is compiled (or ``AMPDOCTOR_MODULE_HOOK=global``), a global forward hook."""
        want = self._attached and self._active and not self._compiled
        if want and not self._listening:
            self._listening = True
            if self._wrap_call:
                fast = None
                root = self._root()
                if self._tap is not None and root is not None:
                    if not self._configured:  # the same modules, in the same order, as self._names
                        self._native.tap_configure(self._tap, [m for _, m in root.named_modules()], self._root,
                                                   self._training_only)
                        self._configured = True
                    fast = self._native.tap_caller(self._tap)  # (one plain C call a module call)
                    if self._sharded:
                        fast = partial(_plain_call, fast)
                listen_calls(self, fast)
            else:
                hook = _global_hook(weakref.ref(self))
                self._handles.append(torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True))
        elif not want and self._listening:
            self._listening = False
            unlisten_calls(self)
            remove_hooks(self._handles)
        sync = getattr(self.tracker, "sync", None)  # a tracker that listens only while the hooks do (watch.opwatch)
        if sync is not None:
            sync(self._listening)

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
        self._tail: tuple[Any, torch.Tensor] | None = None
        self._pgrads_queued = False
        self._unknown: set[str] = set()
        """The kinds (act, grad) of this step whose rows may count a NaN or an infinity: rows the C++ tap made and
        found finite are known finite; any other row of the kind (a tensor queued, the Python path) is not known."""

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
        if self._tap is None and record:
            self._start_native()
        if self._tap is not None:
            self._native.tap_start(self._tap, self._serial, record)
        self._sync_hook()

    def _start_native(self) -> None:
        """Record through the C++ tap from now on, if the kernel is built (checked at each recorded step)."""
        mod = fused.kernel()
        if mod is not None:
            self._native = mod
            # rows made in C++ as each tensor appears (data still in cache, nothing held) where the buffer
            # is the plain one; a buffer of its own (``ampdoctor layers``: several formats) gets the tensors
            rows = type(self._buf) is StatsBuffer
            self._tap = mod.Tap(self._buf.flush_numel, self.activations, self.grads, rows, *_thresholds(self.fmt),
                                partial(_drain, weakref.ref(self)))

    def _take_native(self) -> None:
        """Move what the C++ tap holds into this step's record: calls, activations, gradients (in arrival order),
        in one call that gives None for each part where nothing came since the last take."""
        if self._tap is None:
            return
        calls, acts, grads = self._native.tap_take(self._tap)
        if calls is not None:
            mods, bounds, tids = calls
            if mods:
                st = self._cur
                st.flat_calls.append((self._mods, mods, bounds, tids))  # Call objects made when read
                root = self._root_index
                # the model's own calls: their inputs and outputs (every call of the step: accumulated micro-batches)
                k = -1
                for _ in range(mods.count(root)):  # (count and index: no Python loop over the calls)
                    k = mods.index(root, k + 1)
                    st.model_inputs = tuple(st.model_inputs) + tuple(tids[bounds[2 * k]: bounds[2 * k + 1]])
                    st.model_outputs = tuple(st.model_outputs) + tuple(tids[bounds[2 * k + 1]: bounds[2 * k + 2]])
        if acts is not None:
            self._put_acts(acts)
        if grads is not None:
            self._put_grads(grads)

    def take_acts(self) -> None:
        """Take the activations the C++ tap queued (``watch.calls.NativeListener``)."""
        self._put_acts(self._native.tap_take_acts(self._tap))

    def _put_acts(self, taken: tuple[Any, ...]) -> None:
        tids, ts, numel, mixed, rtids, rows, bad = taken
        if tids:
            self._buf.add_many(self._keyed("act", tids), ts, numel, mixed)
            self._unknown.add("act")  # (their rows are made later: whether they are finite is not known here)
        if rtids:
            self._buf.add_rows(self._keyed("act", rtids), rows)
            if bad:
                self._unknown.add("act")

    def _keyed(self, kind: str, tids: list[int]) -> list[Hashable]:
        """The buffer's keys ``(kind, tid)`` of these tensor ids: the last list again when the ids repeat (the same
        calls every step), so that the rows' keys are the same objects from step to step (cheap to compare)."""
        last = self._key_cache.get(kind)
        if last is not None and (last[0] is tids or last[0] == tids):
            return last[1]
        keys: list[Hashable] = [(kind, t) for t in tids]
        self._key_cache[kind] = (tids, keys)
        return keys

    @property
    def recording(self) -> bool:
        return self._active

    @property
    def current(self) -> StepStats:
        """The step being recorded (its calls and gradient order are on the host; rows come at ``end_step``)."""
        self._take_native()
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
            self._unknown.add("act")
        if self.grads and t.requires_grad and self._grad_enabled:
            t.register_hook(partial(self._on_grad, self._serial, tid))
        return tid

    def _on_grad(self, serial: int, tid: int, g: torch.Tensor) -> None:
        if self._active and serial == self._serial and g is not None:
            try:
                self._cur.grad_order.append(tid)
                self._buf.add(("grad", tid), g)
                self._unknown.add("grad")
            except Exception as e:  # never in the user's backward
                self._active = False
                listener_failed(self, e)

    def _take_grads(self) -> None:
        """Move the gradients the C++ tap queued (in arrival order) into this step's record."""
        if self._tap is None:
            return
        self._put_grads(self._native.tap_take_grads(self._tap))

    def _put_grads(self, taken: tuple[Any, ...]) -> None:
        order, tids, grads, numel, mixed, rtids, rows, bad = taken
        self._cur.grad_order.extend(order)
        if tids:
            self._buf.add_many(self._keyed("grad", tids), grads, numel, mixed)
            self._unknown.add("grad")
        if rtids:
            self._buf.add_rows(self._keyed("grad", rtids), rows)
            if bad:
                self._unknown.add("grad")

    def _tids_of(self, obj: Any) -> list[int]:
        # fast paths for the common shapes: one tensor, or a tuple of tensors
        if type(obj) is torch.Tensor:
            return [self._tid(obj)] if obj.is_floating_point() else []
        if type(obj) is tuple and all(type(t) is torch.Tensor for t in obj):
            return [self._tid(t) for t in obj if t.is_floating_point()]
        return [self._tid(t) for t in iter_tensors(obj) if t.is_floating_point()]

    def after_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """A module call returned (``watch.calls.CallListener``): record it when it is one of the model's."""
        if not self._active:
            return
        if self._sharded:
            args, kwargs, output = _plain(args), _plain(kwargs), _plain(output)
        idx = self._index.get(id(module))
        if idx is None:  # another model's module (the hook is process-wide)
            return
        if self._training_only and not (torch.is_grad_enabled() and _training(self._root)):
            return
        if self._tap is not None:
            if self._native.tap_record(self._tap, idx, args, kwargs, output, torch.is_grad_enabled()):
                self.take_acts()  # bounded: the queue holds a flush's worth at most
            return
        name = self._mods[idx]
        self._grad_enabled = torch.is_grad_enabled()
        ins = tuple(self._tids_of(args if not kwargs else (args, kwargs)))
        outs = tuple(self._tids_of(output))
        self._cur.calls.append(Call(name, ins, outs))
        if id(module) == self._root_id:  # (every call of the step: accumulated micro-batches)
            self._cur.model_inputs = tuple(self._cur.model_inputs) + ins
            self._cur.model_outputs = tuple(self._cur.model_outputs) + outs

    def add_scalar(self, name: str, value: torch.Tensor | float) -> None:
        """Queue a scalar (a 0-d tensor stays on the device) to come back with this step's copy."""
        if isinstance(value, torch.Tensor):
            self._scalars.append((name, value.detach().reshape(()).to(torch.float64)))
        else:
            self._cur.extra[name] = float(value)

    def add_scalars(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        """Queue a vector of named scalars (1-D, float64, on the device) in one go: the step recipe's own."""
        self._vector = (names, values)

    def add_tail(self, layout: Any, values: torch.Tensor) -> None:
        """Queue a 1-D vector that comes back whole in this step's copy, as ``StepStats.tail = (layout, values)``
        (the lookback ring's per-parameter figures: no name per value)."""
        self._tail = (layout, values.detach().reshape(-1).to(torch.float64))

    def grads_with_norms(self, params: list[Any], grads: list[torch.Tensor]) -> torch.Tensor | None:
        """Queue this step's parameter-gradient rows and return each gradient's float32 L2 norm, from one read of
        the gradients (the C++ kernel sums the squares of a chunk right after counting it), or None, and nothing
        queued, where that does not apply: a step not recorded, gradients not watched, no kernel, a sharded
        model or a buffer of its own, ``params`` not exactly this model's parameters in order (``grads`` their
        gradients, each present, on the CPU). The rows are the ones ``after_backward`` would queue, which then
        queues nothing more: the gradients must not change before it (no clip, no unscale in between)."""
        if (not (self._active and self.grads) or self._native is None or self._sharded or self._pgrads_queued
                or type(self._buf) is not StatsBuffer or len(grads) != len(self._params)):
            return None
        same = self._same
        if same is None or same[0] is not params:
            same = self._same = (params, len(params) == len(self._params)
                                 and all(a is b for a, b in zip(params, self._params, strict=True)))
        if not same[1] or not grads or grads[0].device.type != "cpu":
            return None
        self._take_native()  # (the rows keep their order: activations and their gradients first)
        out = fused.fused_stats_norms(grads, *_thresholds(self.fmt))
        if out is None:
            return None
        self._buf.add_rows(self._pgrad_list, out[0])
        self._pgrads_queued = True
        return out[1]

    def after_backward(self, inv_scale: float | None = None) -> None:
        """Queue parameter gradients (after ``scaler.unscale_`` when a scaler is used).

        ``inv_scale``: the gradients still carry a loss scale (a loop that has not unscaled yet); their
        rows are those of the gradients times it, as ``unscale_`` would make them (nothing is written)."""
        if not (self._active and self.grads):
            return
        if self._pgrads_queued:  # (``grads_with_norms`` queued them this step)
            self._take_native()
            return
        self._take_native()
        have = [p.grad for p in self._params]
        keys: list[Hashable]
        grads: list[torch.Tensor]
        if not self._sharded and not any(g is None for g in have):  # every parameter has its gradient (the usual step)
            keys, grads, numel = self._pgrad_list, cast(list[torch.Tensor], have), self._param_numel
        else:
            keys, grads, numel = [], [], 0
            for k, p in self._pgrad_keys:
                g = p.grad
                if g is not None:
                    g = local(g)  # a sharded gradient: this rank's shard (the engine reduces the rows across ranks)
                    keys.append(k)
                    grads.append(g)
                    numel += g.numel()
        if keys and inv_scale is not None and inv_scale != 1.0:
            by_dev: dict[torch.device, tuple[list[Hashable], list[torch.Tensor]]] = {}
            for k, g in zip(keys, grads, strict=True):
                ks, gs = by_dev.setdefault(g.device, ([], []))
                ks.append(k)
                gs.append(g)
            for ks, gs in by_dev.values():
                self._buf.add_rows(ks, scaled_stats(gs, self.fmt, inv_scale))
        elif keys:
            self._buf.add_many(keys, grads, numel, self._params_split())  # (a gradient lives with its parameter)

    def _params_split(self) -> bool:
        """Whether the parameters are on more than one device (a model split over GPUs): looked at again when the
        first parameter moves."""
        split = self._split
        first = self._params[0].device if self._params else None
        if split is None or split[0] != first:  # (a model moved with ``.to()``: looked at again)
            split = self._split = (first, len({p.device for p in self._params}) > 1) if first is not None else None
        return split[1] if split is not None else False

    def after_step(self) -> None:
        """Queue parameter values after the optimizer update."""
        if not (self._active and self.params):
            return
        if self._param_keys:  # (a model split over devices: the buffer groups them per device)
            params = self._params if not self._sharded else [local(p) for p in self._params]
            self._buf.add_many(self._param_keys, params, sum(p.numel() for p in params) if self._sharded
                               else self._param_numel, self._params_split())

    def end_step(self, exchange: Callable[[list[Hashable], torch.Tensor], torch.Tensor] | None = None) -> StepStats:
        """Reduce everything queued this step and bring it to the host (one transfer).

        ``exchange(keys, rows)``: called with the reduced rows still on the device, returns a 1-D
        tensor (the ranks' all-reduce) that comes back in the same copy, as ``self.exchanged``."""
        st = self._cur
        self._take_native()
        self._serial += 1  # a gradient arriving after the step ended belongs to no step
        if self._tap is not None:
            self._native.tap_start(self._tap, self._serial, False)
        keys, rows = self._buf.collect()
        extra = exchange(keys, rows).reshape(-1).to(torch.float64) if exchange is not None else None
        self.exchanged = None
        vec = self._vector
        self._vector = None
        tail = self._tail
        self._tail = None
        if tail is not None:  # after the exchange's numbers, in the same copy
            ext = tail[1] if extra is None else torch.cat([extra, tail[1].to(extra.device)])
            extra, ntail = ext, tail[1].numel()
        else:
            ntail = 0
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
            flat_d = torch.cat(parts) if len(parts) > 1 else parts[0]
            if rows.device.type == "cpu" and flat_d.device.type == "cpu":  # on the host already: no packing, no copy
                host = rows.numpy()
                flat = flat_d.numpy()
            else:  # the rows and the scalars in one copy
                host = torch.cat([rows, _scalar_rows(flat_d, rows.device, rows.shape[1] or NCOLS)]).cpu().numpy()
                flat = host[len(keys):].reshape(-1)
            nsc = len(names)
            for name, v in zip(names, flat[:nsc], strict=True):
                st.extra[name] = float(v)
            if extra is not None:
                nex = extra.numel() - ntail
                if exchange is not None:
                    self.exchanged = flat[nsc: nsc + nex].copy()
                if tail is not None:
                    st.tail = (tail[0], flat[nsc + nex: nsc + nex + ntail].copy())
            host = host[: len(keys)]
        else:
            host = rows.cpu().numpy()
        # (the dicts are made when someone reads them; the kinds whose rows are all known finite are said with them)
        st.set_rows(cast(list[tuple[str, Any]], keys), host, finite=tuple(k for k in ("act", "grad") if k not in self._unknown))
        self._tids = {}
        return st


def _scalar_rows(values: torch.Tensor, device: torch.device, width: int = NCOLS) -> torch.Tensor:
    """Pack scalars into whole stats-width rows so they travel in the same copy."""
    n = values.numel()
    nrows = -(-n // width)
    out = torch.zeros(nrows * width, dtype=torch.float64, device=device)
    out[:n] = values
    return out.view(nrows, width)


