"""The English of the triage stages and of where a triage started: what to do about a stage's exception, and the
report's notes on the batches, the device, the start (a capture, a checkpoint, a skipped dataloader) and the
RNG. The engine hands codes and figures (``engine.stages``, ``engine.triage``);
``report.stages`` picks the sentences from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# a stage that raised: what to do about it -------------------------------------------------------------------

ERROR_HINTS: Mapping[str | None, str] = {
    "onednn_fp16": ("oneDNN has no FP16 kernel for this op on the CPU: a device limitation, not a NaN cause. "
                    "Run triage with --device cuda, or keep this module in FP32 under autocast(enabled=False)."),
    "no_half_kernel": "this op has no FP16 kernel on this device: a device limitation, not a NaN cause.",
    None: "the stage stopped at this exception; fix it and rerun (the other stages still ran).",
}
"""By the kernel the device lacks (``judge.rules.kernel_limit``); None: any other exception."""


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
             replays: int) -> str:
    """The replay of a capture: which step, which rank, how many replays failed again."""
    m = manifest
    world = int(m.get("world_size") or 1)
    if world > 1:
        who = f" on rank {m.get('rank')} of {world}"
        ranks = (f"; ranks that saw it: {m['ranks']}" if m.get("ranks") else "") + (
            f" (only rank {m.get('first_rank')} in its own batch or forward: the others were clean)"
            if m.get("others_clean") and m.get("first_rank") is not None else "")
    else:
        who = ranks = ""
    return (f"replayed from the capture {capture} of step {m.get('step')} ({m.get('reason')}){who}: "
            f"{n_steps} step(s) from the run's step {step0}; the {precision} replay "
            f"failed again {reproduced} of {replays} times{ranks}")


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


__all__ = ["CPU_AUTOCAST", "ERROR_HINTS", "MODEL_INPUTS", "cycled", "epochs", "error_hint", "replayed", "rng", "start"]
