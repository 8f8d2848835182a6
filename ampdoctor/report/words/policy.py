"""The English of the autocast op policy a CPU triage followed (``ladder.policy``): CUDA's, emulated,
and which ops it ran differently from CPU autocast, or could not emulate. ``report.policy`` picks them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _names(ops: Sequence[str]) -> str:
    ops = list(ops)
    return ops[0] if len(ops) == 1 else ", ".join(ops[:-1]) + " and " + ops[-1]


def cuda_policy(f: Mapping[str, Any]) -> str:
    """The note of a run under CUDA's op policy: why it was used, what ran in FP32, what could not be emulated."""
    low = {"bfloat16": "BF16"}.get(str(f.get("dtype")), "FP16")
    why = (f"the capture is of a CUDA run ({f['run_device']}): its replay followed CUDA autocast's op policy, emulated "
           "on the CPU (--autocast-policy native replays under CPU autocast's)"
           if f.get("reason") == "capture" else
           "autocast followed CUDA's op policy, emulated on the CPU (--autocast-policy cuda)")
    up = list(f.get("fp32") or [])
    said = (f"{_names(up)} ran in FP32 on {low} inputs, as CUDA autocast runs {'it' if len(up) == 1 else 'them'}, "
            f"where CPU autocast keeps {'it' if len(up) == 1 else 'them'} in {low}" if up else
            f"no op of this model met an {low} input that CUDA autocast runs in FP32")
    out = f"{why}: {said}"
    if f.get("not_emulated"):
        out += (f"; not emulated: {_names(f['not_emulated'])} (casts both ways inside one call: it ran under CPU "
                "autocast's policy)")
    if f.get("fused"):
        out += (f"; {_names(f['fused'])} runs in a fused kernel on CUDA (flash or memory-efficient attention): its "
                f"inputs were cast as on CUDA, its inside is the CPU kernel's")
    return out


__all__ = ["cuda_policy"]
