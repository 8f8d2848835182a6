"""The English of the triage stages and of where a triage started: what to do about a stage's exception, and the
report's notes on the batches, the device, the start (a capture, a checkpoint, a skipped dataloader) and the
RNG. The engine hands codes and figures (``engine.stages``, ``engine.triage``);
``report.stages`` picks the sentences from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# a stage that raised: what to do about it -------------------------------------------------------------------

ERROR_HINTS: Mapping[str | None, str] = {
    "onednn_fp16": ("oneDNN has no FP16 kernel for this op on the CPU: a device limitation, not a NaN cause. "
                    "Run triage with --device cuda, or keep this module in FP32 under autocast(enabled=False)."),
    "no_half_kernel": "this op has no FP16 kernel on this device: a device limitation, not a NaN cause.",
    None: "the stage stopped at this exception; fix it and rerun (the other stages still ran).",
}
"""By the kernel the device lacks (``judge.detectors.kernel_limit``); None: any other exception."""


def error_hint(kind: str | None) -> str:
    """What to do about a stage's exception."""
    return ERROR_HINTS.get(kind, ERROR_HINTS[None])


# the report's notes ------------------------------------------------------------------------------------------

def cycled(n_batches: int, steps: int) -> str:
    return f"the dataloader yields {n_batches} batch(es); they were cycled to make {steps} steps"


CPU_AUTOCAST = ("ran on the CPU: CPU autocast keeps softmax, exp, pow, layer_norm, sum and mean in FP16 where "
                "CUDA autocast runs them in FP32, so a verdict can differ on a GPU")

MODEL_INPUTS = ("the capture kept the model's own inputs (no batch= was passed), not the targets of "
                "its loss: the replay ran the forward alone, which tells data from forward range; a failure "
                "in backward is not re-reached this way: pass batch= (mon.step(loss, batch=...))")


def replayed(capture: Any, manifest: Mapping[str, Any], n_steps: int, step0: int, precision: str, reproduced: int,
             replays: int, differs: Sequence[Sequence[str]] = ()) -> str:
    """The replay of a capture: which step, which rank, how many replays failed again; where the replay's model
    differs from the run's (``differs``: module, the run's settings, the replay's)."""
    m = manifest
    world = int(m.get("world_size") or 1)
    if world > 1:
        who = f" on rank {m.get('rank')} of {world}"
        ranks = (f"; ranks that saw it: {m['ranks']}" if m.get("ranks") else "") + (
            f" (only rank {m.get('first_rank')} in its own batch or forward: the others were clean)"
            if m.get("others_clean") and m.get("first_rank") is not None else "")
    else:
        who = ranks = ""
    diff = ""
    if differs:
        name, run, here = differs[0]
        more = len(differs) - 1
        diff = (f"; the replay's model is not the run's: {name or '<model>'} is {here or 'missing'} here and "
                f"{run or 'missing'} in the run" + (f" (and {more} more module(s) differ)" if more else ""))
    return (f"replayed from the capture {capture} of step {m.get('step')} ({m.get('reason')}){who}: "
            f"{n_steps} step(s) from the run's step {step0}; the {precision} replay "
            f"failed again {reproduced} of {replays} times{ranks}{diff}")


def start(kind: str, step0: int, label: str = "") -> str:
    """Where every stage started: 'the initial weights', 'the captured weights at step 8,217', 'checkpoint-130'."""
    if kind == "capture":
        return f"the captured weights at step {step0:,}"
    if kind == "checkpoint":
        return label or f"the checkpoint of step {step0:,}"
    return "the initial weights"


def _not_restored(source: str, seed: int) -> str:
    return (f"RNG not restored: {source}, so every stage is seeded with --seed {seed}; "
            "a step that draws randomness draws other numbers than the run's")


def rng(replay: bool, restored: list[str], seed: int, step0: int, after_step: int | None) -> str:
    """Whether the run's RNG states were restored before every stage (``restored``: which), and what that means
    for a step that draws randomness (dropout, a timestep drawn in the step). ``replay``: from a capture (else a
    checkpoint); ``after_step``: the capture's rng.pt was taken after this step's own draws (None: before)."""
    got = ", ".join(restored)
    if replay:
        if not restored:
            return _not_restored("the capture holds no rng.pt", seed)
        if after_step is not None:
            return (f"RNG restored before every stage and replay ({got}) from rng.pt, which was taken after step "
                    f"{after_step:,}'s own draws: a step that draws randomness (dropout, a timestep or noise drawn in the step) "
                    "replays the same draws every time, the ones that followed the run's, not the run's own")
        return f"RNG restored before every stage and replay ({got}) from rng.pt: the replayed steps draw what the run drew"
    if not restored:
        return _not_restored("the checkpoint holds no RNG state", seed)
    return (f"RNG restored before every stage ({got}) from the checkpoint's RNG state, saved with it after step "
            f"{step0:,}: a step that draws randomness draws what the run drew next")


def epochs(epoch: int, at: int, how: str) -> str:
    """How ``--skip-batches`` reached epoch ``epoch`` (batch ``at`` of it); ``how``: 'set_epoch' (the loader or a
    sampler has it), 'global_rng' (a RandomSampler without a generator) or 'in_order'."""
    head = f"the skip went through {epoch} whole epoch(s) of the dataloader and on to batch {at} of epoch {epoch}"
    if how == "set_epoch":
        return head + " (set_epoch called for each, as the run's loop does)"
    if how == "global_rng":
        return (head + "; its RandomSampler has no generator, so each epoch's order was drawn from the global RNG "
                "here, not as the run drew it: the batches after the first epoch may not be the run's (give the "
                "DataLoader a seeded generator, or use --from a capture)")
    return head + " (each epoch iterated in order, as the run's loop does)"


# where the model, the loss and the optimizer came from, and where a checkpoint started ------------------------


def own_loss(source: str, loss: str, fn: str = "") -> str:
    """A model rebuilt from a capture's ``model_identity`` (``source``, the rebuild's words), with its loss:
    'training_step' (a LightningModule's), 'model' (the model's own), 'recorded' (``fn`` of the output, as the
    capture read it from the run's autograd graph), '' (the spec's)."""
    if loss == "recorded":
        return f"{source}; the loss is {fn} of its output and the batch's targets, as the run's autograd graph recorded it"
    return source + {"training_step": ", with its own training_step as the loss", "model": ", with the model's own loss"}.get(loss, "")


def training_step_loss(cls: str, spec_has_none: bool) -> str:
    """The loss is a LightningModule's training_step: the spec has no loss_fn (a replay), or as the run computed it."""
    return f"the loss is {cls}.training_step" + (" (the spec has no loss_fn)" if spec_has_none else ", as the run computed it")


def lightning_optimizer(cls: str, groups: list[int]) -> str:
    """The optimizer a LightningModule's configure_optimizers() builds (``groups``: parameters per group)."""
    return (f"the optimizer and its {len(groups)} parameter group(s) ({groups}) come "
            f"from {cls}.configure_optimizers(), as Lightning made them")


def layout_optimizer(cls: Any, n_groups: int) -> str:
    """The optimizer rebuilt from a capture's ``optimizer_layout``."""
    return (f"the optimizer is {cls} over the run's {n_groups} parameter "
            "group(s), by parameter name, as the capture recorded them")


def checkpoint_start(layout: str, path: Any, saved_step: int | None, step0: int, skip_batches: int, notes: list[str]) -> str:
    """Where a checkpoint's triage started: its layout and path, the run's step, the dataloader's skipped batches,
    then the checkpoint's own notes."""
    at = (f"saved after the run's step {saved_step}, so the replay's first step is its step {step0}, numbered as "
          "the Trainer logs it" if saved_step is not None and step0 != saved_step else f"the run's step {step0}")
    return (f"started from the {layout} checkpoint {path} ({at}"
            + (f", the dataloader after {skip_batches} batch(es)" if skip_batches else "") + ")"
            + "".join(f"; {n}" for n in notes))


# a sharded capture replayed on N ranks ---------------------------------------------------------------------


def fsdp2_layout(modules: list[str], mesh: tuple[int, ...], dtypes: list[tuple[str, Any]]) -> str:
    """'fsdp2 (fully_shard of blocks.0, the model on a mesh of (2,), MixedPrecisionPolicy(param_dtype=...))':
    the layout a sharded capture recorded (``modules``: '' is the model; ``dtypes``: the policy's set dtypes)."""
    dts = ", ".join(f"{k}={v}" for k, v in dtypes)
    mods = ", ".join(m or "the model" for m in modules)
    return f"fsdp2 (fully_shard of {mods} on a mesh of {mesh}" + (f", MixedPrecisionPolicy({dts})" if dts else "") + ")"


def tp_layout(styles: dict[str, list[str]], mesh: tuple[int, ...]) -> str:
    """'tensor_parallel (ColwiseParallel of embed; RowwiseParallel of mid, head on a mesh of (2,))': the plan a
    tensor-parallel capture recorded (``styles``: each style's modules, '' is the model)."""
    styled = "; ".join(f"{s} of {', '.join(m or 'the model' for m in ms)}" for s, ms in styles.items())
    return f"tensor_parallel ({styled or 'distribute_tensor of its parameters'} on a mesh of {mesh})"


def mesh_layout(engine: str, modules: list[str], mesh: tuple[int, ...], dims: tuple[str, ...], styles: dict[str, str],
                dtypes: list[tuple[str, Any]], over: tuple[str, str] = ("dp", "tp")) -> str:
    """'fsdp2_tp (ColwiseParallel of embed; RowwiseParallel of mid over tp, fully_shard of embed, the model over dp, on a
    mesh of (2, 2) (dp, tp), MixedPrecisionPolicy(...))' or 'hsdp (fully_shard of ..., on a mesh of (2, 2) (replicate,
    shard))': the layout a 2-D mesh capture recorded (``styles``: module -> its parallelize style; ``over``: the names
    of the dimensions fully_shard and the plan run over)."""
    by: dict[str, list[str]] = {}
    for m, st in styles.items():
        by.setdefault(st, []).append(m or "the model")
    tp = "; ".join(f"{st} of {', '.join(ms)}" for st, ms in by.items())
    mods = ", ".join(m or "the model" for m in modules)
    dts = ", ".join(f"{k}={v}" for k, v in dtypes)
    parts = ([f"{tp} over {over[1]}"] if tp else []) + [f"fully_shard of {mods}" + (f" over {over[0]}" if tp else "")]
    return (f"{engine} ({', '.join(parts)}, on a mesh of {mesh}" + (f" ({', '.join(dims)})" if dims else "")
            + (f", MixedPrecisionPolicy({dts})" if dts else "") + ")")


def fsdp1_layout(modules: list[str], strategy: Any, dtypes: list[tuple[str, Any]]) -> str:
    """'fsdp1 (FullyShardedDataParallel of blocks.0, the model, FULL_SHARD, use_orig_params=True, MixedPrecision(...))'."""
    mods = ", ".join(m or "the model" for m in modules)
    dts = ", ".join(f"{k}={v}" for k, v in dtypes)
    return (f"fsdp1 (FullyShardedDataParallel of {mods}, {strategy}, use_orig_params=True"
            + (f", MixedPrecision({dts})" if dts else "") + ")")


def ranks_replayed(nproc: int, layout: str, firsts: list[tuple[str, list[Any] | None]],
                   rules_at: tuple[Any, Any] | None) -> str:
    """The replay on ``nproc`` ranks: per stage, the first non-finite value on any rank ((step, rank, kind, module),
    None: finite on every rank); ``rules_at``: (step, module) the one-process rules point at instead, when they differ."""
    parts = [f"{st}: step {ff[0]}, rank {ff[1]}'s {ff[2]}, first at {ff[3] or 'the model'}" if ff
             else f"{st}: finite on every rank" for st, ff in firsts]
    tail = ("" if rules_at is None else
            f"; the rules, run on the same state on one process, point at step {rules_at[0]} ({rules_at[1]}) instead")
    return (f"replayed on {nproc} ranks under {layout} (each rank its own shard and batch, over gloo): "
            + "; ".join(parts) + tail)


__all__ = ["CPU_AUTOCAST", "ERROR_HINTS", "MODEL_INPUTS", "checkpoint_start", "cycled", "epochs", "error_hint",
           "fsdp2_layout", "layout_optimizer", "mesh_layout", "lightning_optimizer", "own_loss", "ranks_replayed", "replayed", "rng", "start", "training_step_loss"]
