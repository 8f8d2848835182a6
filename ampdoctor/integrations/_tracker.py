"""What the framework callbacks add for the user's tracker and their saves, each called in one line from the
callback: the Monitor's figures in the framework's own logs (``engine.monitor.figures``), and the save-time
check (``Monitor.saving``).

The Trainer hands every ``report_to`` integration the same ``logs`` dict in ``on_log``, in the order of its
callbacks, and puts the reporting ones before the user's: the figures must be in ``logs`` before they run. So
``trainer_logs_first`` puts a small callback of ours (``on_log`` only: it adds the figures to the dict) first in
the Trainer's list, for the run; the list is replaced, never edited while the Trainer walks it.
"""

from __future__ import annotations

import sys
from typing import Any

from ampdoctor.notify import say

FIGURES_DOC = "figures: add the Monitor's figures (ampdoctor/headroom_min, scale, skips, steps_to_overflow) to the framework's logs"


def _handler(callback: Any) -> Any:
    """The Trainer's ``CallbackHandler`` calling ``callback`` now (the frame of its ``call_event``), or None."""
    f = sys._getframe(1)
    for _ in range(12):
        if f is None:
            return None
        owner = f.f_locals.get("self")
        if type(owner).__name__ == "CallbackHandler" and callback in getattr(owner, "callbacks", ()):
            return owner
        f = f.f_back  # type: ignore[assignment]
    return None


def trainer_logs_first(callback: Any) -> None:
    """Call from the callback's ``on_train_begin``: our ``on_log`` first in the Trainer's callbacks (once)."""
    handler = _handler(callback)
    if handler is None:  # a Trainer that calls its callbacks otherwise: said once, the run goes on without figures
        say("ampdoctor: figures=True: the Trainer's callback list was not found from on_train_begin; the figures are "
            "not added to its logs (pass Monitor(on_record=...) through AmpDoctorCallback instead)",
            quiet=bool(callback.monitor_kwargs.get("quiet")))
        return
    if any(getattr(c, "_ampdoctor_of", None) is callback for c in handler.callbacks):
        return
    base = next(c for c in type(callback).__mro__ if c.__name__ == "TrainerCallback")

    def on_log(self: Any, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        mon = callback.monitor
        if mon is None or not isinstance(logs, dict) or "loss" not in logs:  # a training log (not eval, not the summary)
            return
        try:
            logs.update(mon.figures.take())
        except Exception as e:  # the run's own log goes on without the figures
            mon._fail("adding the figures to the Trainer's logs", e)

    first = type("AmpDoctorFigures", (base,), {"on_log": on_log, "_ampdoctor_of": callback})()
    handler.callbacks = [first, *handler.callbacks]


def trainer_saving(callback: Any, args: Any, state: Any, control: Any, *, before: bool) -> None:
    """At ``on_step_end`` (``before``: the Trainer saves this step, after it) and at ``on_save`` (a save nothing
    announced): the save-time check, said once."""
    mon = callback.monitor
    if mon is None or (before and not getattr(control, "should_save", False)):
        return
    if not before and getattr(callback, "_checked_step", None) == state.global_step:
        return
    callback._checked_step = state.global_step
    mon.saving(f"{args.output_dir}/checkpoint-{state.global_step}")


def lightning_figures(callback: Any, pl_module: Any) -> None:
    """After a step: the figures through the LightningModule's ``log_dict`` (on_step), for its loggers."""
    mon = callback.monitor
    if mon is None or not getattr(callback, "figures", False) or mon.off is not None:
        return
    figs = mon.figures.take()
    if figs:
        pl_module.log_dict(figs, on_step=True, on_epoch=False)


def accelerate_hooks(accelerator: Any, mon: Any, figures: bool) -> Any:
    """accelerate: the save-time check as a ``save_state`` pre-hook (where the accelerator has the hook); the
    function to call after each step that logs the figures through ``accelerator.log`` (None: figures off)."""
    register = getattr(accelerator, "register_save_state_pre_hook", None)
    if callable(register):
        register(lambda models, weights, output_dir: None if mon._closed else mon.saving(output_dir))
    if not figures:
        return None

    def log_figures() -> None:
        if mon.off is None and getattr(accelerator, "trackers", None) and mon.last is not None:
            accelerator.log(mon.figures.take(), step=mon.last.step)

    return log_figures


__all__ = ["FIGURES_DOC", "accelerate_hooks", "lightning_figures", "trainer_logs_first", "trainer_saving"]
