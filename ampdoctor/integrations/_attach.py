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
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.engine.monitor import Monitor, MonitorRecord
from ampdoctor.input.batches import Micro
from ampdoctor.watch.hooks import call_wrapping_enabled, listen_calls, remove_hooks, unlisten_calls, unwrap, uses_compile


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returned: ``output.loss``, ``output["loss"]``, or a scalar tensor output."""
    loss = None
    if isinstance(output, dict):
        loss = output.get("loss")
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class ForwardTap:
    """A process-wide forward hook filtered to one model's root (held weakly: nothing is stored on the
    model). On each *training* forward (the root in train mode, grad enabled) it hands the output's
    loss to ``on_loss`` (when ``loss=True``) and keeps the inputs (when ``inputs=True``)."""

    def __init__(self, model: nn.Module, on_loss: Callable[[torch.Tensor], None] | None, inputs: bool) -> None:
        self._root_id = id(unwrap(model))
        self.on_loss = on_loss
        self.keep_inputs = inputs
        self.inputs: list[Any] = []
        self._last: weakref.ref[Any] | None = None
        self._handles: list[Any] = []
        if call_wrapping_enabled() and not uses_compile(model):  # the cheap way (see watch.hooks)
            self._listening = True
            listen_calls(self)
            weakref.finalize(self, unlisten_calls, None)
            return
        self._listening = False
        ref = weakref.ref(self)

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            tap = ref()
            if tap is None or torch.compiler.is_compiling():  # inside a compiled graph: seen from its wrapper
                return
            # the model itself, or a torch.compile wrapper around it (whose call runs outside dynamo)
            if id(module) == tap._root_id or id(getattr(module, "_orig_mod", None)) == tap._root_id:
                tap._seen(module, args, kwargs, output)

        self._handles = [torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)]
        # torch warns on every call of a compiled module while a global hook exists, because the hook also
        # fires for the compile wrapper: that is the call this tap reads (and counts once), so the warning
        # is about us, not the user's code
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
        weakref.finalize(self, remove_hooks, self._handles)

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        # the model itself, or a torch.compile wrapper made later (a Trainer compiles after callbacks exist)
        if id(module) == self._root_id or id(module._modules.get("_orig_mod")) == self._root_id:
            self._seen(module, args, kwargs, output)

    def _seen(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation
        if self._last is not None and self._last() is output:
            return  # the same call seen from a compile wrapper and from the model (dynamo fell back): once
        try:
            self._last = weakref.ref(output)  # weakly: never keeps a step's logits alive
        except TypeError:
            self._last = None
        if self.on_loss is not None:
            loss = output_loss(output)
            if loss is not None:
                self.on_loss(loss)
        if self.keep_inputs:
            # the batch as a spec's dataloader would yield it: the kwargs dict (HF style), else the args
            self.inputs.append(dict(kwargs) if kwargs and not args else (args[0] if len(args) == 1 and not kwargs else args))

    def take(self) -> Any:
        """The step's batch (several micro-batches: a ``Micro``), and forget it."""
        got, self.inputs = self.inputs, []
        if not got:
            return None
        return got[0] if len(got) == 1 else Micro(got)

    def close(self) -> None:
        if self._listening:
            self._listening = False
            unlisten_calls(self)
        remove_hooks(self._handles)


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


class Attached:
    """A Monitor on a framework's model, optimizer and GradScaler, called at the framework's two points."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scaler: Any, *,
                 amp_dtype: torch.dtype | None, first_step: int, log: str | Path | None, capture: str | Path | None,
                 loss_from_output: bool, monitor_kwargs: dict[str, Any]) -> None:
        kw = dict(monitor_kwargs)
        kw.setdefault("max_norm", None)  # the framework clips; the monitor measures
        self.monitor = Monitor(model, optimizer, scaler, log=log, capture=capture, amp_dtype=amp_dtype,
                               first_step=first_step, **kw)
        if self.monitor.writer is not None:  # the framework's step is known: an old log fails before training starts
            try:
                self.monitor.writer.check(first_step)
            except Exception:
                self.monitor.close()
                raise
        self.monitor.hooks.training_only = True  # an evaluation in the middle of training stays out of the statistics
        self.tap = ForwardTap(model, self.monitor.note_loss if loss_from_output else None,
                              inputs=self.monitor.capture is not None)
        self._measured = False

    def note_loss(self, loss: torch.Tensor) -> None:
        self.monitor.note_loss(loss)

    def before_optimizer_step(self, batch: Any = None) -> None:
        """After backward, unscale_ and clip; before ``optimizer.step()``."""
        if self._measured:  # the framework called us twice for one step: keep the first
            return
        b = self.tap.take()
        if batch is None:
            batch = b
        cap = self.monitor.capture
        self.monitor.after_backward(None, batch=batch if cap is not None and not cap.done else None)
        self._measured = True

    def after_optimizer_step(self, applied: bool | None = None) -> MonitorRecord | None:
        """After ``optimizer.step()`` and ``scaler.update()``. ``applied``: what the framework did, when
        the monitor cannot know it (no GradScaler: a non-finite step is applied, not skipped)."""
        if not self._measured:
            return None
        self._measured = False
        return self.monitor.after_step(None if applied is None else not applied)

    def close(self) -> None:
        self.tap.close()
        self.monitor.close()


__all__ = ["Attached", "ForwardTap", "inner_optimizer", "output_loss"]
