"""One line to watch an ``accelerate`` loop: ``watch(accelerator, model, optimizer, ...)``.

::

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    mon = ampdoctor.integrations.accelerate.watch(accelerator, model, optimizer, log="steps.csv", capture="cap")
    for batch in data:                               # the loop is unchanged
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    mon.close()

``watch`` wraps, on these two objects only, ``accelerator.backward`` (to note each micro-batch's
loss, as accelerate divides it for gradient accumulation) and the prepared optimizer's ``step``: on a
step that syncs gradients it calls ``Monitor.after_backward`` before the step (after your
``clip_grad_norm_``, which unscales) and ``Monitor.after_step`` after it; on accumulation steps it
does nothing. ``grad_l2_pre_clip`` is what your ``accelerator.clip_grad_norm_`` returned (the norm
before it clipped), ``grad_l2_post_clip`` the norm the step is taken with; the steps are the monitor's
count of optimizer steps from 0 (``step_convention`` ``monitor``). The GradScaler is ``accelerator.scaler``; the batch for the capture is read from the
model's training forwards. A skip is read from GradScaler's own found-inf flags, never from
``optimizer.step_was_skipped`` (wrong with fused optimizers, accelerate issue 4242). ``close()``
restores both methods. Tested with accelerate 1.15.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.engine.monitor import Monitor
from ampdoctor.engine.monitor.capturing import seen_loss
from ampdoctor.integrations import _tracker
from ampdoctor.integrations._attach import Attached, inner_optimizer


def _amp_dtype(accelerator: Any) -> torch.dtype | None:
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp == "bf16":
        return torch.bfloat16
    if mp == "fp16" and getattr(accelerator, "scaler", None) is not None:
        return torch.float16
    return None  # fp32, or fp16 where accelerate runs no autocast (the CPU)


class _Watch(Monitor):
    """The Monitor ``watch`` returns (made by ``adopt``): ``close()`` also unwraps the accelerator and the optimizer."""

    _restore: list[tuple[Any, str]]
    _attached: Attached

    def close(self) -> None:
        for obj, name in getattr(self, "_restore", []):
            obj.__dict__.pop(name, None)  # the class's own method shows through again
        self._restore = []
        if hasattr(self, "_attached") and self._attached.tap is not None:
            self._attached.tap.close()
        super().close()
        self.__dict__.pop("_restore", None)
        self.__dict__.pop("_attached", None)
        self.__class__ = Monitor  # type: ignore[assignment]  # undone: a plain Monitor again


def adopt(mon: Monitor, attached: Attached, restore: list[tuple[Any, str]]) -> _Watch:
    """The Monitor ``attached`` built, made in place into the one ``watch`` returns. The contract of the swap:

    - ``mon`` stays the same object: its state, hooks, log and capture are untouched; only its class becomes
      ``_Watch``, a ``Monitor`` that overrides ``close`` alone and adds two attributes (``_attached``, ``_restore``);
    - ``restore`` is the (object, name) of each method ``watch`` wrapped as an instance attribute of that object;
    - ``close()`` undoes all of it: the instance attributes go (the class's own methods show through again), the
      tap closes, the monitor closes, and ``mon`` is a plain ``Monitor`` once more (closing it again is safe).
    """
    mon.__class__ = _Watch
    assert isinstance(mon, _Watch)
    mon._attached = attached
    mon._restore = restore
    return mon


def watch(accelerator: Any, model: nn.Module, optimizer: Any, *, log: str | Path | None = "ampdoctor/steps.csv",
          capture: str | Path | None = None, figures: bool = False, **monitor_kwargs: Any) -> Monitor:
    """Attach a ``Monitor`` to a prepared model and optimizer; returns it (``close()`` detaches).

    ``monitor_kwargs`` go to ``ampdoctor.Monitor`` (``mode="sentinel"``, ``every``, ``alert_rate`` ...).
    Call after ``accelerator.prepare``. ``figures``: log the Monitor's figures (``ampdoctor/headroom_min``...)
    with ``accelerator.log`` after each step (when trackers were initialised). ``accelerator.save_state`` checks
    the state first (``Monitor.saving``).
    """
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
    scaler = getattr(accelerator, "scaler", None)
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    a = Attached(model, inner_optimizer(optimizer), scaler, amp_dtype=_amp_dtype(accelerator), first_step=0, log=log,
                 asked={"fp16": "fp16", "bf16": "bf16"}.get(mp, "fp32"), framework=f"accelerate (mixed_precision={mp!r})",
                 capture=capture, loss_from_output=False, monitor_kwargs=monitor_kwargs)
    mon = adopt(a.monitor, a, [])
    log_figures = _tracker.accelerate_hooks(accelerator, mon, figures)
    backward, step = accelerator.backward, optimizer.step

    def watched_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        n = max(1, int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1))
        seen_loss(a.monitor, loss)  # how the loss came from the model's output (its graph, before the detach)
        a.note_loss(loss.detach() / n if n > 1 else loss)  # what accelerate backpropagates
        return backward(loss, **kwargs)

    def watched_step(*args: Any, **kwargs: Any) -> Any:
        if not getattr(accelerator, "sync_gradients", True):
            return step(*args, **kwargs)  # an accumulation step: accelerate does nothing either
        a.before_optimizer_step()
        try:
            return step(*args, **kwargs)
        finally:
            a.after_optimizer_step(applied=None if mon.scaler is not None else True)
            if log_figures is not None:
                log_figures()

    accelerator.backward = watched_backward
    optimizer.step = watched_step
    mon._restore = [(accelerator, "backward"), (optimizer, "step")]
    return mon


__all__ = ["adopt", "watch"]
