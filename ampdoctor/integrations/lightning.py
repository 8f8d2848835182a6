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
``scaler.step``) and ``on_train_batch_end`` (after ``scaler.update()``). The step is measured right
after Lightning's clipping: the precision plugin's ``_clip_gradients`` (which runs the module's
``configure_gradient_clipping``) is wrapped on that plugin object alone, called as it is, and the
measurement follows it. So ``grad_l2_post_clip`` is the norm the optimizer steps with, and
``grad_l2_pre_clip`` the one ``torch.nn.utils.clip_grad_norm_`` returned inside Lightning's
``clip_gradients`` (``_attach.ClipObserver``; measured before the clip for
``gradient_clip_algorithm="value"`` or a ``configure_gradient_clipping`` of the module's own). A
plugin that does not clip there is measured at ``on_before_optimizer_step``, before any clip. A skip
is read from GradScaler's own found-inf flags.

Rows are numbered as Lightning's loggers number the step: ``trainer.global_step`` while the step runs
(CSVLogger's ``step`` for what ``training_step`` logged; ``step_convention`` ``lightning_global_step``).

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

from ampdoctor.capture.state import model_identity
from ampdoctor.input.batches import Micro
from ampdoctor.integrations import _tracker
from ampdoctor.integrations._attach import Attached, inner_optimizer

try:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.plugins.precision import Precision
except ImportError:  # the older package name
    from pytorch_lightning import LightningModule  # type: ignore[no-redef,assignment]
    from pytorch_lightning.plugins.precision import Precision  # type: ignore[no-redef,assignment,attr-defined]

_AMP = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16": torch.float16, "bf16": torch.bfloat16}


class AmpDoctorCallback(Callback):  # type: ignore[misc]
    """Watches a Lightning run with a ``Monitor`` (first optimizer only).

    Args:
        log: the step-log CSV (``steps.rank1.csv`` per rank under torch.distributed); None: no file.
        capture: the folder written on the first failing step; None: off.
        figures: log the Monitor's figures (``ampdoctor/headroom_min``, ``ampdoctor/scale``...) with the
            LightningModule's ``log_dict`` each step, for its loggers.
        **monitor_kwargs: passed to ``ampdoctor.Monitor`` (``mode="sentinel"``, ``full_every``, ``every``,
            ``activations``, ``alert_rate``, ``max_skip_rate``, ``snapshot_every``, ``inject_inf_at`` ...).
    """

    def __init__(self, log: str | Path | None = "ampdoctor/steps.csv", capture: str | Path | None = None,
                 figures: bool = False, **monitor_kwargs: Any) -> None:
        super().__init__()
        self.figures = figures
        self.log_file = log
        self.capture_dir = capture
        self.monitor_kwargs = monitor_kwargs
        self.attached: Attached | None = None
        self._batches: list[Any] = []
        self._plugin: Any = None
        self._due: tuple[Any] | None = None
        """The step's batch, measured once Lightning has clipped (``_clip_gradients``)."""
        self._identity: dict[str, Any] | None = None

    @property
    def monitor(self) -> Any:
        """The ``Monitor`` (after ``on_train_start``): its ``last`` record, ``skips``, ``first_fault``..."""
        return self.attached.monitor if self.attached is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Saved in each ``.ckpt`` (its ``callbacks`` entry): the LightningModule's import path and ``hparams``
        (``model_identity``), so ``ampdoctor triage --checkpoint run.ckpt`` rebuilds it without a spec."""
        return {"model_identity": self._identity} if self._identity is not None else {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        try:
            self._identity = model_identity(pl_module)
        except Exception:  # the .ckpt then needs a spec to replay; the run goes on
            self._identity = None
        self._unwrap_clip()
        if self.attached is not None:
            self.attached.close()
        if self.log_file is not None:
            Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
        plugin = getattr(trainer, "precision_plugin", None) or trainer.strategy.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        amp = _AMP.get(str(getattr(plugin, "precision", trainer.precision)))
        opt = inner_optimizer(trainer.optimizers[0]) if trainer.optimizers else None
        # the number Lightning's loggers give the step (one a batch that stepped; its global step with one optimizer)
        stepped = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "_batches_that_stepped", None)
        first = stepped if isinstance(stepped, int) else trainer.global_step
        self._due = None
        self.attached = Attached(pl_module, opt, scaler, amp_dtype=amp, first_step=first, log=self.log_file,
                                 capture=self.capture_dir, loss_from_output=False, step_convention="lightning_global_step",
                                 monitor_kwargs={"log_mode": "append", **self.monitor_kwargs})
        self._wrap_clip(plugin, trainer, pl_module)

    def _wrap_clip(self, plugin: Any, trainer: Any, pl_module: Any) -> None:
        """Measure after Lightning's clip: wrap ``_clip_gradients`` on this plugin object (its class untouched)
        where the plugin's ``_after_closure`` is Lightning's own, which calls it right after
        ``on_before_optimizer_step``."""
        self._plugin = None
        if (self.attached is None or self.attached.monitor.off is not None or plugin is None
                or getattr(type(plugin), "_after_closure", None) is not Precision._after_closure
                or not callable(getattr(plugin, "_clip_gradients", None)) or "_clip_gradients" in vars(plugin)):
            return
        original = plugin._clip_gradients
        own_clip = type(pl_module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping

        def _clip_gradients(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                due = self._due is not None and inner_optimizer(optimizer) is self._monitor_optimizer()
                if due and (own_clip or (trainer.gradient_clip_val and str(trainer.gradient_clip_algorithm) != "norm")):
                    self._note_norm_before_clip()  # a clip that is not clip_grad_norm_: its input measured here
            except Exception:  # nothing of ampdoctor's stands between Lightning and its clip
                due = False
            result = original(model, optimizer, *args, **kwargs)
            if due:
                self._measure()
            return result

        plugin._clip_gradients = _clip_gradients
        self._plugin = plugin

    def _monitor_optimizer(self) -> Any:
        return self.attached.monitor.optimizer if self.attached is not None else None

    def _note_norm_before_clip(self) -> None:
        a = self.attached
        if a is None or a.monitor.off is not None:
            return
        try:
            grads = [p.grad for p in a.monitor.recipe.params if p.grad is not None]
            if grads:  # read only, on the device: no sync
                a.monitor.note_clip(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))))
        except Exception as e:
            a.monitor._fail("measuring the norm before Lightning's clip", e)

    def _measure(self) -> None:
        a, due, self._due = self.attached, self._due, None
        if a is not None and due is not None:
            a.before_optimizer_step(due[0])

    def _unwrap_clip(self) -> None:
        plugin, self._plugin = self._plugin, None
        if plugin is not None:
            vars(plugin).pop("_clip_gradients", None)  # the class's own method shows through again

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
        batch = got[0] if len(got) == 1 else (Micro(got) if got else None)
        if self._plugin is not None:  # measured right after Lightning's clip, which follows this hook
            self._due = (batch,)
            return
        a.before_optimizer_step(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        a = self.attached
        if a is not None:  # only after an optimizer step (gradient accumulation: every N batches)
            self._due = None  # (Lightning's _after_closure always clips; a measurement after the step would be wrong)
            a.after_optimizer_step(applied=None if a.monitor.scaler is not None else True)
            _tracker.lightning_figures(self, pl_module)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.attached is not None:  # before Lightning writes it: said once when the state is damaged
            self.attached.monitor.saving(f"the checkpoint of step {trainer.global_step}")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._unwrap_clip()
        if self.attached is not None:
            self.attached.close()


__all__ = ["AmpDoctorCallback"]
