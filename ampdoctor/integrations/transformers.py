"""``AmpDoctorCallback`` for the Hugging Face ``Trainer``.

::

    from ampdoctor.integrations.transformers import AmpDoctorCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[AmpDoctorCallback(log="ampdoctor/steps.csv", capture="ampdoctor/capture")])
    trainer.train()

Per optimizer step it writes the step log (loss, gradient norms, scale, skipped and why, the first
module whose gradient went non-finite), takes per-layer statistics (``mode="sentinel"`` for the
always-on mode of long runs), raises the skip-rate alert, and on the first failing step writes a
capture for ``ampdoctor triage SPEC --from FOLDER``. Under ``torchrun`` each rank writes its own log
and the logs say which rank went first (see ``Monitor(distributed=...)``).

Where the Trainer keeps what the monitor needs (transformers 5.24 with accelerate 1.15, tested):
the model is the callback's ``model`` argument (the unwrapped model), the optimizer is
``AcceleratedOptimizer.optimizer``, and the GradScaler is ``AcceleratedOptimizer.scaler`` (None
without fp16 on a device that needs one: accelerate makes none on the CPU). The callback runs at
``on_pre_optimizer_step`` (after the Trainer's ``unscale_`` and clip) and ``on_step_end``.

The log is numbered as the Trainer numbers its steps: a row's ``step`` is ``state.global_step`` after
the step (the ``step`` of its log history and the N of ``checkpoint-N``; the first row is step 1), and
the ``step_convention`` column says ``trainer_global_step``. ``grad_l2_pre_clip`` is the norm the
Trainer's own ``clip_grad_norm_`` returned (what it logs as ``grad_norm``); ``grad_l2_post_clip`` is the
norm after that clip, measured at ``on_pre_optimizer_step``.

Two things the Trainer hides that the log shows:

- a NaN/Inf loss: with ``logging_nan_inf_filter=True`` (the default) the Trainer's logged loss
  replaces it with the running mean; the step log has the real value, and the callback warns;
- a skipped step: read from GradScaler's own found-inf flags at the step's host copy, never from
  accelerate's ``optimizer.step_was_skipped`` (which is wrong with fused optimizers, accelerate
  issue 4242).

The loss is read from each training forward's output (``outputs.loss``), which is what the Trainer
uses unless ``compute_loss`` is overridden to compute the loss outside the model; then the step log's
loss is empty, and non-finite losses still show as skipped steps (their gradients are non-finite).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ampdoctor.integrations import _tracker
from ampdoctor.integrations._attach import Attached, inner_optimizer
from ampdoctor.notify import say


class AmpDoctorCallback(TrainerCallback):  # type: ignore[misc]
    """Watches a ``Trainer`` run with a ``Monitor``.

    Args:
        log: the step-log CSV (``steps.rank1.csv`` per rank under torch.distributed); None: no file.
        capture: the folder written on the first failing step; None: off.
        figures: add the Monitor's figures (``ampdoctor/headroom_min``, ``ampdoctor/scale``, ``ampdoctor/skips``,
            ``ampdoctor/steps_to_overflow``...) to the Trainer's ``logs``, so every ``report_to`` shows them.
        **monitor_kwargs: passed to ``ampdoctor.Monitor`` (``mode="sentinel"``, ``full_every``,
            ``every``, ``activations``, ``alert_rate``, ``max_skip_rate``, ``snapshot_every``,
            ``inject_inf_at`` ...). The Trainer clips, so the monitor only measures.
    """

    def __init__(self, log: str | Path | None = "ampdoctor/steps.csv", capture: str | Path | None = None,
                 figures: bool = False, **monitor_kwargs: Any) -> None:
        self.figures = figures
        self.log_file = log
        self.capture_dir = capture
        self.monitor_kwargs = monitor_kwargs
        self.attached: Attached | None = None
        self._said_hidden = False

    @property
    def monitor(self) -> Any:
        """The ``Monitor`` (after ``on_train_begin``): its ``last`` record, ``skips``, ``first_fault``..."""
        return self.attached.monitor if self.attached is not None else None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if self.attached is not None:  # a second train() on the same callback
            self.attached.close()
        if self.log_file is not None:
            Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
        scaler = getattr(optimizer, "scaler", None)
        if args.bf16:
            amp: torch.dtype | None = torch.bfloat16
        elif args.fp16 and scaler is not None:
            amp = torch.float16
        else:  # fp32, or fp16 where accelerate makes no scaler and no autocast (the CPU)
            amp = None
        self._said_hidden = False
        asked = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        # a row's step is the Trainer's: its global_step after the step (the ``step`` of its log history, the N
        # of the checkpoint-N saved after it), so a fresh run's first row is step 1
        self.attached = Attached(model, inner_optimizer(optimizer), scaler, amp_dtype=amp, first_step=state.global_step + 1,
                                 asked=asked, framework="the Trainer (TrainingArguments)", step_convention="trainer_global_step",
                                 log=self.log_file, capture=self.capture_dir, loss_from_output=True,
                                 monitor_kwargs={"log_mode": "append", **self.monitor_kwargs})
        if args.logging_nan_inf_filter:  # said with the run's first failure, in its one message (issue 45)
            self.attached.monitor.loss_note = "the Trainer's own log hides it (logging_nan_inf_filter=True)"
        if self.figures:
            _tracker.trainer_logs_first(self)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attached is not None:
            self.attached.before_optimizer_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        a = self.attached
        if a is None:
            return
        # without a GradScaler the Trainer applies every step, finite or not
        rec = a.after_optimizer_step(applied=None if a.monitor.scaler is not None else True)
        _tracker.trainer_saving(self, args, state, control, before=True)
        if (rec is not None and not self._said_hidden and not (rec.loss == rec.loss and abs(rec.loss) != float("inf"))
                and args.logging_nan_inf_filter):
            self._said_hidden = True  # once a run: the step log has every one
            if a.monitor.first_failure is not None and a.monitor.first_failure[0] == rec.step:
                return  # the failure's own message said it: one message for the event
            where = f"the step log has it: {a.monitor.log_path}" if a.monitor.log_path is not None else "pass log= to keep a step log"
            say(f"ampdoctor: step {rec.step}: the loss is {rec.loss}; the Trainer's own log hides it "
                f"(logging_nan_inf_filter=True); {where}", quiet=a.monitor.quiet)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _tracker.trainer_saving(self, args, state, control, before=False)
        if self.monitor is not None:  # the capture starts from this checkpoint by reference (capture.reference)
            self.monitor.saved(Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attached is not None:
            self.attached.close()


__all__ = ["AmpDoctorCallback"]
