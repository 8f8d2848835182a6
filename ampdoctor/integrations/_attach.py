"""What the framework integrations share: a ``Monitor`` driven from a framework's own step.

A framework runs forward, backward, ``unscale_``, clipping, ``scaler.step`` and ``update`` itself;
the integration calls the Monitor at two points of that step, as a hand-written loop would:

- **before the optimizer step** (after backward, and after the framework's own ``unscale_`` and
  clip): ``Monitor.after_backward`` — norms, per-layer statistics, the skip decision read from
  GradScaler's found-inf flags, the step's one host copy (and, under torch.distributed, the ranks'
  all-reduce);
- **after the optimizer step**: ``Monitor.after_step`` — the log row, skip rate, capture.

The loss comes from the framework's hook where it has one (Lightning's ``on_before_backward``,
``accelerator.backward``); the Trainer has none, so it is read from the model's own output
(``output.loss``) of each training forward. The batch (for the capture) is the model's inputs of
each training forward, kept only while a capture is armed; several micro-batches (gradient
accumulation) are kept as one step.

The pre-clip norm is the framework's own: while a monitor is attached, ``torch.nn.utils.clip_grad_norm_``
(which Lightning's ``clip_gradients`` and accelerate before 1.16 call) and ``torch.nn.utils.clip_grads_with_norm_``
(which accelerate 1.16's ``clip_grad_norm_``, and so the Trainer's clip, calls with the total it computed)
are observed (``ClipObserver``): each wrapper calls the original with the same arguments and hands the
total norm before clipping to the monitor whose parameters it clipped. The monitor measures
after the clip, so ``grad_l2_post_clip`` is the norm the optimizer steps with.
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.engine.monitor import Monitor, MonitorRecord
from ampdoctor.notify import say
from ampdoctor.watch.tap import ForwardTap, output_loss


def precision_ran(amp_dtype: torch.dtype | None, scaler: Any) -> str:
    """What a step really computes: 'fp16' (FP16 autocast with an enabled GradScaler), 'fp16_autocast' (no
    scaler), 'bf16', or 'fp32'."""
    enabled = scaler is not None and getattr(scaler, "is_enabled", lambda: True)()
    if amp_dtype == torch.float16:
        return "fp16" if enabled else "fp16_autocast"
    if amp_dtype == torch.bfloat16:
        return "bf16"
    return "fp32"


def _rank0() -> bool:
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except Exception:  # pragma: no cover
        return True


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a framework's wrapper (accelerate's ``AcceleratedOptimizer``, itself an
    ``Optimizer`` subclass; Lightning's ``LightningOptimizer``): GradScaler keys its per-optimizer state
    by the inner one, which is what the framework passes to ``scaler.unscale_`` and ``scaler.step``."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


_Listener = Callable[[list[Any], Any], None]


def _weak(listener: _Listener) -> Callable[[], _Listener | None]:
    """A weak reference to a bound method (a plain function is held as it is)."""
    if hasattr(listener, "__self__"):
        return weakref.WeakMethod(listener)  # type: ignore[arg-type]
    return lambda: listener


class ClipObserver:
    """Observes the clip functions of ``torch.nn.utils`` while at least one listener is registered.

    Two entry points carry a step's pre-clip norm: ``clip_grad_norm_`` returns it (the Trainer before
    accelerate 1.16, Lightning's ``clip_gradients``, hand-written loops), and ``clip_grads_with_norm_`` is
    handed it (accelerate 1.16's ``clip_grad_norm_`` computes ``get_total_norm`` itself, then calls
    ``clip_grads_with_norm_`` once per device mesh with that total). Each wrapper calls the original with
    the caller's own arguments (a generator of parameters is made a list first, as the original does
    itself; an empty generator is passed on as one, so its warning stays) and returns the original's result
    untouched; each listener is then given the parameters and the total norm. Nothing is written. A call
    made from inside another observed call (a torch whose ``clip_grad_norm_`` calls the public
    ``clip_grads_with_norm_``) is not told twice. The attributes are restored when the last listener leaves
    (each one only if nothing replaced it since). Listeners are held weakly: a monitor that was never
    closed (a run that died) is not kept alive by it.
    """

    NAMES = ("clip_grad_norm_", "clip_grads_with_norm_")
    _lock = threading.Lock()
    _listeners: list[Callable[[], _Listener | None]] = []
    _originals: dict[str, Callable[..., Any]] = {}
    _wrappers: dict[str, Callable[..., Any]] = {}
    _inside = threading.local()

    @classmethod
    def add(cls, listener: _Listener) -> None:
        with cls._lock:
            cls._listeners.append(_weak(listener))
            for name in cls.NAMES:
                original = getattr(torch.nn.utils, name, None)  # (clip_grads_with_norm_: torch >= 2.6)
                if original is None or (name in cls._wrappers and original is cls._wrappers[name]):
                    continue
                cls._originals[name] = original
                cls._wrappers[name] = cls._wrap(name, original)
                setattr(torch.nn.utils, name, cls._wrappers[name])

    @classmethod
    def _wrap(cls, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        returns_norm = name == "clip_grad_norm_"

        @functools.wraps(original)
        def wrapper(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            listeners = [fn for fn in (ref() for ref in list(cls._listeners)) if fn is not None]
            nested = getattr(cls._inside, "depth", 0) > 0
            if not listeners or nested or isinstance(parameters, torch.Tensor):
                params = [parameters] if isinstance(parameters, torch.Tensor) and not nested else None
                call_with = parameters
            else:
                was_generator = isinstance(parameters, types.GeneratorType)
                params = list(parameters)
                call_with = params if params or not was_generator else (p for p in params)
            cls._inside.depth = getattr(cls._inside, "depth", 0) + 1
            try:
                result = original(call_with, *args, **kwargs)
            finally:
                cls._inside.depth -= 1
            if params is not None and listeners:
                total = result if returns_norm else kwargs.get("total_norm", args[1] if len(args) > 1 else None)
                if total is not None:
                    for fn in listeners:
                        try:
                            fn(params, total)
                        except Exception:  # noqa: S112  # a listener turns its own monitor off; the clip is done
                            continue
            return result

        return wrapper

    @classmethod
    def remove(cls, listener: _Listener) -> None:
        with cls._lock:
            cls._listeners[:] = [ref for ref in cls._listeners if (fn := ref()) is not None and fn != listener]
            if cls._listeners:
                return
            for name, wrapper in list(cls._wrappers.items()):
                if getattr(torch.nn.utils, name, None) is wrapper:
                    setattr(torch.nn.utils, name, cls._originals[name])
                del cls._wrappers[name]
                cls._originals.pop(name, None)


class Attached:
    """A Monitor on a framework's model, optimizer and GradScaler, called at the framework's two points."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scaler: Any, *,
                 amp_dtype: torch.dtype | None, first_step: int, log: str | Path | None, capture: str | Path | None,
                 loss_from_output: bool, monitor_kwargs: dict[str, Any], asked: str | None = None,
                 framework: str = "the framework", step_convention: str = "monitor") -> None:
        kw = dict(monitor_kwargs)
        kw.setdefault("max_norm", None)  # the framework clips; the monitor measures
        kw.setdefault("step_convention", step_convention)  # the step numbers the framework's own log gives
        ran = precision_ran(amp_dtype, scaler)
        if asked is not None and asked != ran and not kw.get("quiet") and _rank0():
            # once, at the start: a run that asked for fp16 and trains in FP32 finds no FP16 problem to find
            say(f"ampdoctor: {framework} was asked for {asked} but runs {ran}"
                + (" (no GradScaler and no FP16 autocast on this device)" if asked == "fp16" and ran == "fp32" else "")
                + "; the step log and the capture describe what ran")
        self.monitor = Monitor(model, optimizer, scaler, log=log, capture=capture, amp_dtype=amp_dtype,
                               first_step=first_step, **kw)
        self.tap: ForwardTap | None = None
        self._measured = False
        if self.monitor.capture is not None:  # the manifest's Monitor settings say what was asked and what ran
            self.monitor.capture.settings.update(asked_precision=asked, ran_precision=ran)
        if self.monitor.off is not None:  # a setup it cannot read: it said so once; the callbacks do nothing
            return
        if self.monitor.writer is not None:  # the framework's step is known: an old log fails before training starts
            try:
                self.monitor.writer.check(first_step)
            except Exception:
                self.monitor.close()
                raise
        self.monitor.hooks.training_only = True  # an evaluation in the middle of training stays out of the statistics
        # the loss from each training forward's output (the monitor keeps the batch itself, with its own tap)
        if loss_from_output:
            self.tap = ForwardTap(model, self.monitor.note_loss, inputs=False)
            self.tap.on_error = self.monitor._hook_failed
        self._ids = {id(p) for p in self.monitor.recipe.params}
        ClipObserver.add(self._clipped)

    def _clipped(self, params: list[Any], total: Any) -> None:
        """The framework's ``clip_grad_norm_`` returned ``total`` for ``params``: this step's pre-clip norm, if
        they are this monitor's (a second model's clip is not)."""
        mon = self.monitor
        if mon.off is not None or not any(id(p) in self._ids for p in params):
            return
        try:
            mon.note_clip(total)
        except Exception as e:
            mon._fail("reading the framework's clip_grad_norm_", e)

    def note_loss(self, loss: torch.Tensor) -> None:
        self.monitor.note_loss(loss)

    def before_optimizer_step(self, batch: Any = None) -> None:
        """After backward, unscale_ and clip; before ``optimizer.step()``."""
        if self._measured:  # the framework called us twice for one step: keep the first
            return
        self.monitor.after_backward(None, batch=batch)
        self._measured = True

    def after_optimizer_step(self, applied: bool | None = None) -> MonitorRecord | None:
        """After ``optimizer.step()`` and ``scaler.update()``. ``applied``: what the framework did, when
        the monitor cannot know it (no GradScaler: a non-finite step is applied, not skipped)."""
        if self._end_of_step():
            return None
        self._measured = False
        return self.monitor.after_step(None if applied is None else not applied)

    def _end_of_step(self) -> bool:
        """No measurement this step (or the monitor is off): a clip norm noted late is dropped, not carried on."""
        if self.monitor.off is None:
            self.monitor.recipe.clip_norm = None
        return not self._measured

    def close(self) -> None:
        ClipObserver.remove(self._clipped)
        if self.tap is not None:
            self.tap.close()
        self.monitor.close()


__all__ = ["Attached", "ClipObserver", "ForwardTap", "inner_optimizer", "output_loss", "precision_ran"]  # (the tap lives in watch.tap)
