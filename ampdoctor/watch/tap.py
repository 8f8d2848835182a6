"""``ForwardTap``: the model's own inputs and loss, read from each training call of its root module.

A framework hides the loss (the Trainer has no hook for it) and the loop hides the batch (``Monitor``
without ``batch=``); both pass through the call of the model's root module, which the same
``nn.Module.__call__`` wrapper ``Hooks`` uses already sees. The tap keeps, per step, the inputs of
each training call (references only, copied to the host by the capture at the step's one host copy:
the batch kept for a step is the one its forward consumed, whatever the loop fetches next), and
hands the output's loss to a callback. Nothing is stored on the model.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampdoctor.input.batches import Micro, ModelInputs
from ampdoctor.input.loss import model_loss
from ampdoctor.watch.calls import call_wrapping_enabled, listen_calls, remove_hooks, track_calls, unlisten_calls, uses_compile
from ampdoctor.watch.model_view import unwrap


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returned (``output.loss``, ``output["loss"]`` or the output itself), by the one rule of
    ``input.loss``: a one-element tensor, any shape, is the loss."""
    return model_loss(output)


class ForwardTap:
    """A listener of every module call filtered to one model's root (``watch.calls``: a ``CallListener``, and a
    ``CallTracker`` when ``on_start`` is given; else a process-wide forward hook), held weakly: nothing is stored on
    the model. On each *training* forward (the root in train mode, grad enabled) it hands the output's
    loss to ``on_loss`` (when ``loss=True``) and keeps the inputs (when ``inputs=True``)."""

    def __init__(self, model: nn.Module, on_loss: Callable[[torch.Tensor], None] | None, inputs: bool,
                 on_start: Callable[[], None] | None = None) -> None:
        self._root_id = id(unwrap(model))
        self.on_loss = on_loss
        self.keep_inputs = inputs
        self.on_start = on_start
        """Called as each training call of the model begins (before its forward draws any random number)."""
        self.inputs: list[Any] = []
        self._last: weakref.ref[Any] | None = None
        self.own_loss = False
        """The last training output carried the model's own loss (``output.loss`` / ``output["loss"]``)."""
        self.on_error: Callable[[BaseException], None] | None = None
        """Called when the tap raised inside the user's forward (it stops listening)."""
        self._handles: list[Any] = []
        if call_wrapping_enabled() and not uses_compile(model):  # the cheap way (see watch.calls)
            self._listening = True
            listen_calls(self)
            if on_start is not None:
                track_calls(self)  # (its enter_call: the start of a call)
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
                try:
                    tap._seen(module, args, kwargs, output)
                except Exception as e:  # never in the user's forward
                    tap.close()
                    if tap.on_error is not None:
                        tap.on_error(e)

        self._handles = [torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)]
        # torch warns on every call of a compiled module while a global hook exists, because the hook also
        # fires for the compile wrapper: that is the call this tap reads (and counts once), so the warning
        # is about us, not the user's code
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
        weakref.finalize(self, remove_hooks, self._handles)

    def after_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """A module call returned (``watch.calls.CallListener``)."""
        # the model itself, or a torch.compile wrapper made later (a Trainer compiles after callbacks exist)
        if id(module) == self._root_id or id(module._modules.get("_orig_mod")) == self._root_id:
            self._seen(module, args, kwargs, output)

    def enter_call(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """A call begins (``watch.calls.CallTracker``): the model's own training call tells ``on_start``."""
        if self.on_start is not None and id(module) == self._root_id and module.training and torch.is_grad_enabled():
            try:
                self.on_start()
            except Exception as e:  # never in the user's forward
                self.on_start = None
                if self.on_error is not None:
                    self.on_error(e)
        return False  # (no leave_call needed)

    def leave_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Never called: ``enter_call`` returns False."""

    def _seen(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation
        if self._last is not None and self._last() is output:
            return  # the same call seen from a compile wrapper and from the model (dynamo fell back): once
        self.own_loss = not isinstance(output, torch.Tensor) and model_loss(output) is not None
        try:
            self._last = weakref.ref(output)  # weakly: never keeps a step's logits alive
        except TypeError:
            self._last = None
        if self.on_loss is not None:
            loss = output_loss(output)
            if loss is not None:
                self.on_loss(loss)
        if self.keep_inputs:
            # keyword inputs alone (Hugging Face style, labels included): the dict, as a spec's dataloader
            # yields it; else the call's arguments as they were (the targets may live outside the model)
            self.inputs.append(dict(kwargs) if kwargs and not args else ModelInputs(tuple(args), dict(kwargs)))

    def take(self) -> Any:
        """The step's batch (several micro-batches: a ``Micro``), and forget it."""
        got, self.inputs = self.inputs, []
        if not got:
            return None
        return got[0] if len(got) == 1 else Micro(got)

    def close(self) -> None:
        self.inputs = []
        if self._listening:
            self._listening = False
            unlisten_calls(self)
        remove_hooks(self._handles)


__all__ = ["ForwardTap", "output_loss"]
