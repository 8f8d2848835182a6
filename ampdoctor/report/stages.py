"""The stages' part of a report, from the engine's codes and figures: the hint on a stage's exception, and the
notes on the batches, the device, where the stages started and the RNG (each stage's line of the report is
``report.build.stage_summary``). The sentences are ``report.words.stages``'."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ampdoctor.report.words import run as run_words
from ampdoctor.report.words import stages as words


def error_hint(kind: str | None) -> str:
    """The hint a stage's ``StageError`` carries: by the kernel the device lacks (``judge.detectors.kernel_limit``'s
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


@dataclass(frozen=True)
class Source:
    """Where the model, its loss or the optimizer of a replay or a checkpoint's triage came from (the report's
    first notes, ``source`` words it)."""

    code: Literal["rebuilt", "training_step", "lightning_optimizer", "layout_optimizer"]
    """rebuilt: the model the capture's ``model_identity`` describes (``text``: the rebuild's words, ``loss``: which
    loss); training_step: a LightningModule's training_step is the loss (``name``: its class; ``spec_has_none``: the
    spec has no loss_fn, else as the run computed it); lightning_optimizer: its configure_optimizers()
    (``groups``: parameters per group); layout_optimizer: rebuilt from the capture's ``optimizer_layout`` (``name``:
    the class, ``count``: its parameter groups)."""
    name: str = ""
    text: str = ""
    loss: Literal["", "training_step", "model", "recorded"] = ""
    spec_has_none: bool = False
    groups: tuple[int, ...] = ()
    count: int = 0


def source(s: Source) -> str:
    """The note on where the model, its loss or the optimizer came from."""
    if s.code == "rebuilt":
        return words.own_loss(s.text, s.loss, s.name)
    if s.code == "training_step":
        return words.training_step_loss(s.name, s.spec_has_none)
    if s.code == "lightning_optimizer":
        return words.lightning_optimizer(s.name, list(s.groups))
    return words.layout_optimizer(s.name, s.count)


def checkpoint_start(layout: str, path: Any, saved_step: int | None, step0: int, skip_batches: int,
                     notes: list[str]) -> str:
    """Where a checkpoint's triage started (``words.stages.checkpoint_start``)."""
    return words.checkpoint_start(layout, path, saved_step, step0, skip_batches, notes)


def layout(recipe: Mapping[str, Any]) -> str:
    """How a sharded capture's model was sharded (its manifest's ``shards.recipe``), in words."""
    if recipe.get("engine") == "tensor_parallel":
        styles: dict[str, list[str]] = {}
        for name, st in (recipe.get("plan") or {}).items():
            styles.setdefault(st["style"], []).append(name)
        return words.tp_layout(styles, tuple(recipe.get("mesh") or []))
    if recipe.get("engine") == "fsdp1":
        return words.fsdp1_layout(list(recipe.get("wrapped") or []), recipe.get("sharding_strategy"),
                                  [(k, v) for k, v in (recipe.get("mixed_precision") or {}).items() if v])
    mp = recipe.get("mp_policy") or {}
    if recipe.get("engine") in ("fsdp2_tp", "hsdp"):
        return words.mesh_layout(str(recipe["engine"]), list(recipe.get("fully_shard") or []), tuple(recipe.get("mesh") or []),
                                 tuple(recipe.get("mesh_dim_names") or ()), {n: st["style"] for n, st in (recipe.get("plan") or {}).items()},
                                 [(k, v) for k, v in mp.items() if k.endswith("dtype") and v],
                                 (str(recipe.get("dp", "dp")), str(recipe.get("tp", "tp"))))
    return words.fsdp2_layout(list(recipe.get("fully_shard") or []), tuple(recipe.get("mesh") or []),
                              [(k, v) for k, v in mp.items() if k.endswith("dtype") and v])


def ranks_replayed(nproc: int, layout: str, firsts: list[tuple[str, list[Any] | None]],
                   rules_at: tuple[Any, Any] | None) -> str:
    """The note on a replay on ``nproc`` ranks (``words.stages.ranks_replayed``)."""
    return words.ranks_replayed(nproc, layout, firsts, rules_at)


__all__ = ["Source", "checkpoint_start", "epochs", "error_hint", "layout", "notes", "ranks_replayed", "rng",
           "source", "start"]


def hooks_kept(kept: list[str], lost: list[str], total: int) -> list[str]:
    """The note on the user's gradient hooks the stages kept and lost (``words.run.hooks_kept``)."""
    return run_words.hooks_kept(kept, lost, total)
