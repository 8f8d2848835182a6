"""The stages' part of a report, from the engine's codes and figures: each stage's summary, the hint on a stage's
exception, and the notes on the batches, the device, where the stages started and the RNG. The sentences are
``report.words.stages``'."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from ampdoctor.records import StageResult
from ampdoctor.report.model import StageSummary
from ampdoctor.report.words import stages as words


def error_hint(kind: str) -> str:
    """The hint a ``StageError`` of this kind carries (``engine.stages.error_kind``)."""
    return words.error_hint(kind)


def summary(res: StageResult, fp32: StageResult | None) -> StageSummary:
    """One stage's row of the report: its figures per step, its error, why it stopped early."""
    recs = res.records
    fp32_loss = None
    if fp32 is not None and fp32.records and recs:
        fp32_loss = fp32.records[min(len(fp32.records), len(recs)) - 1].loss  # same step, same batch
    error = {k: v for k, v in asdict(res.error).items() if k != "kind"} if res.error else None
    return StageSummary(
        name=res.name,
        steps_run=len(recs),
        first_nonfinite_step=res.first_nonfinite_step,
        skipped_steps=res.skipped_steps,
        final_scale=recs[-1].scaler_scale if recs and recs[-1].scaler_scale is not None else None,
        final_loss=recs[-1].loss if recs else None,
        fp32_loss=fp32_loss,
        losses=[r.loss for r in recs],
        scales=[r.scaler_scale for r in recs],
        grad_norms=[r.grad_l2_pre_clip for r in recs],
        error=error,
        stopped=stopped(res),
        master_weights=res.master_weights,
    )


def stopped(res: StageResult) -> str | None:
    """Why the stage stopped before its last step, in words (None: it did not); a code the engine did not write
    (a hand-made result) is kept as it is."""
    if not res.stopped:
        return None
    if res.stopped in words.STOPPED and res.stopped_step is not None:
        return words.stopped(res.stopped, res.stopped_step)
    return res.stopped


def start(kind: str, step0: int, label: str = "") -> str:
    """Where every stage started, as the report says it (``words.stages.start``)."""
    return words.start(kind, step0, label)


def rng(replay: bool, restored: list[str], seed: int, step0: int, manifest: Mapping[str, Any] | None) -> str:
    """The RNG note of a replay (``manifest``: the capture's) or of a checkpoint's start."""
    after = manifest.get("rng_after_step") if manifest is not None else None
    after_step = after if isinstance(after, int) and after >= step0 else None
    return words.rng(replay, restored, seed, step0, after_step)


def epochs(epoch: int, at: int, how: str) -> str:
    """How ``--skip-batches`` reached the epoch it starts in (``words.stages.epochs``)."""
    return words.epochs(epoch, at, how)


def notes(*, said: list[str], start_note: str, replay: Mapping[str, Any] | None, rng_note: str | None,
          model_inputs: bool, cycled: tuple[int, int] | None, cpu: bool) -> list[str]:
    """The report's notes, in order: where the model, optimizer and data came from (``said``), where the stages
    started (``start_note``: a checkpoint's), the replay of a capture (``replay``: ``words.stages.replayed``'s
    arguments) with its RNG note, the forward-only replay of the model's own inputs, the cycled dataloader
    (``cycled``: its batches, the steps) and the CPU's autocast."""
    out: list[str] = []
    if cycled is not None:
        out.append(words.cycled(*cycled))
    if cpu:
        out.append(words.CPU_AUTOCAST)
    if replay is not None:
        out.insert(0, words.replayed(**replay))
        if model_inputs:
            out.insert(1, words.MODEL_INPUTS)
    if start_note:
        out.insert(0, start_note)
    if rng_note is not None:
        out.insert(1, rng_note)
    return [*said, *out]


__all__ = ["epochs", "error_hint", "notes", "rng", "start", "stopped", "summary"]
