"""What the sentences of a diagnosis share: the facts they read (``Facts``), numbers to 3 or 4 significant digits,
how an op, the first layer, a list of hooks and a custom Function's place are named, and the phases of a scale."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ampdoctor.fmt import num

Facts = Mapping[str, Any]


def g3(x: Any) -> str:
    return num(float(x), 3)


def g4(x: Any) -> str:
    return num(float(x), 4)


def op_name(f: Facts) -> str:
    """The op that made the NaN/Inf, as 'the `exp` at spec.py:13' names it (without 'the')."""
    op = f.get("op")
    if op is None:
        return "an op"
    line = f.get("op_line")
    return f"`{op}`" + (f" at {line}" if line else "")


def first_layer(f: Facts) -> str:
    return f.get("module") or "the first layer"


def hooks_in(hooks: list[str]) -> str:
    return ", ".join(hooks[:5])


def custom_where(f: Facts) -> str:
    fn = f["function"]
    return f"{f['module']}'s custom autograd.Function {fn}" if f.get("module") else f"custom autograd.Function {fn}"


PHASES = {
    "calibration": "probing a scale above any that had carried a step",
    "growth_probe": "probing a doubled scale after its growth interval",
    "isolated": "meeting one overflow at an established scale",
    "backoff": "backing off as the gradients grew to the scale's limit",
}
