"""The stages' part of a report, from the engine's codes and figures: the hint on a stage's exception, and the
notes on the batches, the device, where the stages started and the RNG (each stage's line of the report is
``report.build.stage_summary``). The sentences are ``report.words.stages``'."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ampdoctor.report.words import stages as words


def error_hint(kind: str | None) -> str:
    """The hint a stage's ``StageError`` carries: by the kernel the device lacks (``judge.rules.kernel_limit``'s
    code), None for any other exception."""
    return words.error_hint(kind)


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


__all__ = ["epochs", "error_hint", "notes", "rng", "start"]
