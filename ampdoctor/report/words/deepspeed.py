"""The DeepSpeed integration's sentences (``report.alerts`` hands them the facts)."""

from __future__ import annotations

from ampdoctor.report.words.monitor import unreadable_layout


def zero_stage(stage: int) -> str:
    """Why the monitor is off under a ZeRO stage ``watch`` cannot read (``monitor_off``'s ``why``)."""
    why = "ZeRO-3 partitions the parameters too" if stage == 3 else "stage 0 has no ZeRO optimizer"
    return unreadable_layout(f"DeepSpeed ZeRO stage {stage} is not supported yet (ampdoctor reads ZeRO stages 1 and 2: {why})")


def replay_hint(where: object, spec: str) -> str:
    """Where a rank's capture went, and the command that replays every rank's pieces on one process."""
    return (f"captured to {where}: this rank's piece of a DeepSpeed ZeRO model, beside every other rank's\n"
            f"  replay it (the ranks' pieces reassembled on one process): ampdoctor triage {spec} --from {where}")


NO_BACKWARD = ("ampdoctor: engine.step() came without engine.backward(loss) since the last step: call engine.backward(loss), "
               "not loss.backward() (DeepSpeed scales the loss and reduces the gradients there, and ampdoctor reads the loss "
               "there); the step log's loss column stays empty until then")
"""Said once: a step at the boundary came without ``engine.backward(loss)``."""


__all__ = ["NO_BACKWARD", "replay_hint", "zero_stage"]
