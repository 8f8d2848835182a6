"""``AmpDoctorCallback`` for Lightning (``lightning.pytorch``; ``pytorch_lightning`` works too).

::

    from ampdoctor.integrations.lightning import AmpDoctorCallback

    trainer = L.Trainer(precision="16-mixed",
                        callbacks=[AmpDoctorCallback(log="ampdoctor/steps.csv", capture="ampdoctor/capture")])
    trainer.fit(module, datamodule)

Per optimizer step: the step log (loss, gradient norms, scale, skipped and why, the first module
whose gradient went non-finite), per-layer statistics (``mode="sentinel"`` for long runs), the
skip-rate alert, and a capture of the first failing step for ``ampdoctor triage SPEC --from``.

Where Lightning keeps what the monitor needs (Lightning 2.6, tested): the GradScaler is the
precision plugin's ``scaler`` (``trainer.precision_plugin``; None for ``bf16-mixed`` and
``32-true``), the optimizer is ``trainer.optimizers[0]``. The hooks used: ``on_train_batch_start``
(the batch, for the capture), ``on_before_backward`` (the loss, before Lightning scales it),
``on_before_optimizer_step`` (after Lightning's ``scaler.unscale_``, before its clipping and
``scaler.step``) and ``on_train_batch_end`` (after ``scaler.update()``). Gradient norms are taken
before Lightning's clipping; a skip is read from GradScaler's own found-inf flags.

Unlike ``detect_anomaly``, which raises on GradScaler's ordinary calibration skips, the callback
logs them and judges them: a capture is written only for a skip at a scale that had already carried
an applied step, a NaN loss, or the skip-rate alert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef,assignment]

from ampdoctor.input.batches import Micro
from ampdoctor.integrations._attach import Attached, inner_optimizer

_AMP = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16": torch.float16, "bf16": torch.bfloat16}


class AmpDoctorCallback(Callback):  # type: ignore[misc]
    """Watches a Lightning run with a ``Monitor`` (first optimizer only).

    Args:
        log: the step-log CSV (``steps.rank1.csv`` per rank under torch.distributed); None: no file.
        capture: the folder written on the first failing step; None: off.
        **monitor_kwargs: passed to ``ampdoctor.Monitor`` (``mode="sentinel"``, ``full_every``, ``every``,
            ``activations``, ``alert_rate``, ``max_skip_rate``, ``snapshot_every``, ``inject_inf_at`` ...).
    """

    def __init__(self, log: str | Path | None = "ampdoctor/steps.csv", capture: str | Path | None = None,
                 **monitor_kwargs: Any) -> None:
        super().__init__()
        self.log_file = log
        self.capture_dir = capture
        self.monitor_kwargs = monitor_kwargs
        self.attached: Attached | None = None
        self._batches: list[Any] = []

    @property
    def monitor(self) -> Any:
        """The ``Monitor`` (after ``on_train_start``): its ``last`` record, ``skips``, ``first_fault``..."""
        return self.attached.monitor if self.attached is not None else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.attached is not None:
            self.attached.close()
        if self.log_file is not None:
            Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
        plugin = getattr(trainer, "precision_plugin", None) or trainer.strategy.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        amp = _AMP.get(str(getattr(plugin, "precision", trainer.precision)))
        opt = inner_optimizer(trainer.optimizers[0]) if trainer.optimizers else None
        self.attached = Attached(pl_module, opt, scaler, amp_dtype=amp, first_step=trainer.global_step, log=self.log_file,
                                 capture=self.capture_dir, loss_from_output=False,
                                 monitor_kwargs={"log_mode": "append", **self.monitor_kwargs})

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        a = self.attached
        if a is not None and a.monitor.capture is not None and not a.monitor.capture.done:
            self._batches.append(batch)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        a = self.attached
        if a is None:
            return
        sc = a.monitor.scaler
        if sc is not None:  # Lightning hands the hook the loss it already scaled: divide on the device (exact: a power of 2)
            s = getattr(sc, "_scale", None)
            loss = loss.detach() / (s if isinstance(s, torch.Tensor) else sc.get_scale())
        a.note_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        a = self.attached
        if a is None or inner_optimizer(optimizer) is not a.monitor.optimizer:
            return
        got, self._batches = self._batches, []
        a.before_optimizer_step(got[0] if len(got) == 1 else (Micro(got) if got else None))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        a = self.attached
        if a is not None:  # only after an optimizer step (gradient accumulation: every N batches)
            a.after_optimizer_step(applied=None if a.monitor.scaler is not None else True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.attached is not None:
            self.attached.close()


__all__ = ["AmpDoctorCallback"]
