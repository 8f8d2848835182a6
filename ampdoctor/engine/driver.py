"""The one loop around the step recipe: micro-batches, the update, the step's record, its skip reason, and
when a run of steps stops early.

``engine.step.TrainStep`` orders one step; ``Driver`` runs steps of it over batches the same way for every
caller: the triage stages (``engine.stages``), the FP32 reference steps of ``ampdoctor layers``
(``engine.layers``) and the replay of a capture (triage ``--from``, through the stages). The Monitor, which
gets its loss from the user's loop instead of a batch, builds its records with the same ``skip_reason`` and
``step_record`` and takes the update through ``Driver.apply``.

One step::

    driver.begin(step)                    # the hooks record this step
    bad = driver.accumulate(batch)        # forward + loss + backward of each micro-batch (None: all finite)
    m, label = driver.measure()           # the recipe's one host copy
    swallowed = driver.apply(m)           # step or skip, scaler.update()
    rec = driver.record(step, m)          # the StepRecord, with its skip reason

``Driver.step`` does the five; ``Driver.run`` loops it and says why it stopped early (``STOPS``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ampdoctor.engine.step import Measured, TrainStep
from ampdoctor.input.batches import micro_batches, to_device
from ampdoctor.records import StepRecord, StepStats

NONFINITE_WEIGHTS = "nonfinite_weights"
"""A run stopped because a trained weight became NaN/Inf (nothing more to learn from it)."""
NONFINITE_LOSS = "nonfinite_loss"
"""A run without a GradScaler stopped at a non-finite loss (a plain loop would back-propagate it into the weights)."""
STOPS = (NONFINITE_WEIGHTS, NONFINITE_LOSS)


def skip_reason(m: Measured, skipped: bool, rank: int | None = None) -> str:
    """The step log's ``skip_reason`` of a step whose skip is ``skipped`` (what the optimizer step did).

    A skipped step: the recipe's reason (``nonfinite_loss``, ``nonfinite_grad:<module>``), or
    ``nonfinite_from_rank:<r>`` under torch.distributed when this rank (``rank``) saw nothing of its own and
    the first fault was rank r's (its gradients came through the all-reduce), or ``skipped_by_caller`` when
    the recipe saw nothing non-finite. An applied step with a non-finite loss or gradient:
    ``applied:<reason>``. Else ''."""
    reason = m.reason if skipped else ""
    view = m.ranks
    first = view.first if view is not None else None
    if skipped and first is not None and first.rank != rank and first.local and not any(
            f.local for f in view.faults if f.rank == rank):  # type: ignore[union-attr]
        reason = f"nonfinite_from_rank:{first.rank}"  # clean here: the gradients came through DDP's all-reduce
    if not skipped and m.skip:
        reason = f"applied:{m.reason}"
    if skipped and not reason:
        reason = "skipped_by_caller"
    return reason


def step_record(step: int, m: Measured, *, skipped: bool, reason: str | None = None, batch: int | None = None,
                rank: int | None = None, **fields: Any) -> StepRecord:
    """The one construction of a ``StepRecord`` from a measured step. ``skipped``: what the optimizer step did;
    ``reason`` defaults to ``skip_reason(m, skipped, rank)``. ``fields``: the record's other fields (the
    Monitor's ``skip_rate``, ``injected``, ``stats``...; a stage's ``params_finite``), over the measured ones."""
    values: dict[str, Any] = {
        "lr": m.lr, "loss": m.loss, "grad_l2_pre_clip": m.grad_l2_pre_clip, "grad_l2_post_clip": m.grad_l2_post_clip,
        "scaler_scale": m.scale, "scale_after": m.scale_after_if_skipped if skipped else m.scale_after_if_applied,
        "nonfinite_params": m.bad_params, "nonfinite_count": m.bad_count, "ranks": m.ranks, "rank": rank,
    }
    values.update(fields)
    return StepRecord(step=step, batch=batch, skipped=skipped,
                      skip_reason=skip_reason(m, skipped, rank) if reason is None else reason, **values)


def loss_record(step: int, loss: torch.Tensor, lr: float | None, batch: int | None = None) -> StepRecord:
    """The record of a step stopped at its non-finite loss, before any backward: skipped, no norms, no scale."""
    return StepRecord(step=step, batch=batch, lr=lr, loss=float(loss.detach().float()), grad_l2_pre_clip=math.nan,
                      grad_l2_post_clip=math.nan, skipped=True, skip_reason=NONFINITE_LOSS, scaler_scale=None)


def blank_record(step: int, rank: int | None = None) -> StepRecord:
    """The record of a step nothing measured (the Monitor while it is off): NaN figures, not skipped."""
    return StepRecord(step=step, batch=None, lr=None, loss=math.nan, grad_l2_pre_clip=math.nan,
                      grad_l2_post_clip=math.nan, skipped=False, skip_reason="", scaler_scale=None, rank=rank)


@dataclass
class Stepped:
    """One step the driver ran."""

    record: StepRecord
    measured: Measured | None
    """None: the step stopped at a non-finite loss before its backward (``loss_record``)."""
    stats: StepStats | None
    """The step's per-layer statistics (None on a step the hooks did not record)."""


Update = Callable[[Measured], "float | None"]
"""Takes the update of a measured step in place of ``TrainStep.apply`` (which it calls); returns the share of
the update FP16 weights lost (``StepRecord.update_swallowed_frac``), or None."""


class Driver:
    """Steps of one ``TrainStep`` over batches.

    Args:
        recipe: the step recipe (its policy, optimizer, GradScaler, hooks).
        loss_fn: ``loss_fn(output, target)`` (None: the model's own loss).
        device: where the batches go (None: where they are).
        stop_at_nonfinite_loss: stop a step's micro-batches at a non-finite loss, before its backward (one host
            sync a micro-batch), and the run after that step (``NONFINITE_LOSS``). Triage stages without a
            GradScaler do; with one the recipe skips such a step itself.
        check_weights: after each update, whether every trained weight is still finite (one more host copy),
            ``StepRecord.params_finite``; the run stops after a step that left them non-finite.
        update: takes each update in place of ``recipe.apply`` (``Update``).
    """

    def __init__(self, recipe: TrainStep, loss_fn: Callable[..., Any] | None = None, device: torch.device | None = None,
                 *, stop_at_nonfinite_loss: bool = False, check_weights: bool = False, update: Update | None = None) -> None:
        self.recipe = recipe
        self.loss_fn = loss_fn
        self.device = device
        self.stop_at_nonfinite_loss = stop_at_nonfinite_loss
        self.check_weights = check_weights
        self.update = update
        self.stop: str | None = None
        """Why ``steps`` ended early (``STOPS``), None while every step ran."""
        self.at = 0
        """The step running now (or the last one run): where an exception of the user's code came from."""

    # one step, in parts -----------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """The step starts: the hooks record it (when they record this step)."""
        self.at = step
        if self.recipe.hooks is not None:
            self.recipe.hooks.begin_step(step)

    def accumulate(self, batch: Any, forward: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                   ) -> torch.Tensor | None:
        """Forward, loss and backward of each of the step's micro-batches (gradient accumulation: each loss
        divided by their number, as loops do; one micro-batch: the batch). ``forward()``: a context each forward
        runs in. Returns the non-finite loss that stopped it (``stop_at_nonfinite_loss``), else None."""
        b = to_device(batch, self.device) if self.device is not None else batch
        micro = micro_batches(b)
        for i, mb in enumerate(micro):
            with forward() if forward is not None else contextlib.nullcontext():
                loss = self.recipe.forward(mb, self.loss_fn, zero_grad=i == 0)
            if len(micro) > 1:
                loss = loss / len(micro)
            if self.stop_at_nonfinite_loss and not bool(torch.isfinite(loss)):
                return loss
            self.recipe.backward(loss)
        return None

    def measure(self, loss: torch.Tensor | None = None, before_unscale: Callable[[], str] | None = None, *,
                observe: bool = False) -> tuple[Measured, str]:
        """The recipe's measurement at the step's one host copy (``TrainStep.measure``); without ``loss`` the
        step's loss is the sum of the micro-batch losses its backward saw."""
        return self.recipe.measure(loss, before_unscale, observe=observe)

    def apply(self, m: Measured) -> float | None:
        """The update: step or skip, ``scaler.update()`` (``update`` where one was given). Returns what the
        update hook returns (the lost-update share), else None."""
        if self.update is not None:
            return self.update(m)
        self.recipe.apply(m)
        return None

    def skipped(self, m: Measured) -> bool:
        """What the optimizer step did with a measured step: skipped on a non-finite loss or gradient (always with
        a GradScaler; without one only when the recipe skips non-finite steps), else applied."""
        return m.skip and self.recipe.skip_nonfinite

    def record(self, step: int, m: Measured, *, skipped: bool | None = None, batch: int | None = None,
               rank: int | None = None, **fields: Any) -> StepRecord:
        """The step's record (``step_record``); ``skipped`` defaults to ``skipped(m)``."""
        sk = self.skipped(m) if skipped is None else skipped
        if self.check_weights:
            fields.setdefault("params_finite", self.recipe.weights_finite())
        return step_record(step, m, skipped=sk, batch=batch, rank=rank, **fields)

    def stopped_loss(self, step: int, loss: torch.Tensor, batch: int | None = None) -> Stepped:
        """A step stopped at its non-finite loss: the hooks' statistics of its forward, and its record."""
        hooks = self.recipe.hooks
        st = hooks.end_step() if hooks is not None and hooks.recording else None
        opt = self.recipe.optimizer
        lr = opt.param_groups[0].get("lr", math.nan) if opt is not None and opt.param_groups else math.nan
        return Stepped(loss_record(step, loss, float(lr), batch), None, st)

    # whole steps ------------------------------------------------------------------------------------
    def step(self, step: int, batch: Any, *, batch_index: int | None = None,
             forward: Callable[[], contextlib.AbstractContextManager[Any]] | None = None) -> Stepped:
        """One whole step on ``batch``: begin, accumulate, measure, apply, record."""
        self.begin(step)
        bad = self.accumulate(batch, forward)
        if bad is not None:
            return self.stopped_loss(step, bad, batch_index)
        m, _ = self.measure()
        swallowed = self.apply(m)
        return Stepped(self.record(step, m, batch=batch_index, update_swallowed_frac=swallowed), m, m.stats)

    def stop_of(self, rec: StepRecord) -> str | None:
        """Why a run stops after this step (``STOPS``), or None: the weights went non-finite, or (without a
        GradScaler, stopping at non-finite losses) the loss did."""
        if not rec.params_finite:
            return NONFINITE_WEIGHTS
        if self.stop_at_nonfinite_loss and self.recipe.scaler is None and not math.isfinite(rec.loss):
            return NONFINITE_LOSS
        return None

    def steps(self, steps: int, batch_at: Callable[[int], Any], batch_index: Callable[[int], int] | None = None,
              before: Callable[[int], None] | None = None) -> Iterator[Stepped]:
        """Steps 0..steps-1 on ``batch_at(step)``, one ``Stepped`` each (``before(step)`` first); it ends after a
        step ``stop_of`` stops at (``self.stop`` says why: None when every step ran)."""
        self.stop = None
        for step in range(steps):
            self.at = step
            if before is not None:
                before(step)
            done = self.step(step, batch_at(step), batch_index=batch_index(step) if batch_index is not None else None)
            yield done
            self.stop = self.stop_of(done.record)
            if self.stop is not None:
                return


__all__ = ["NONFINITE_LOSS", "NONFINITE_WEIGHTS", "STOPS", "Driver", "Stepped", "Update", "blank_record", "loss_record",
           "skip_reason", "step_record"]
