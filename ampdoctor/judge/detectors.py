"""Detectors the rules call: the loss, frozen parameters, a custom Function's dtype, the device's kernels, the data.

* ``loss_fault``: every module output of the step is finite, yet the loss is not: the NaN/Inf was made inside the
  loss function (e.g. ``sigmoid`` rounds to exactly 1.0 in FP16, so ``log(1 - p)`` is -inf).
* ``frozen_params``: most of a parameter's FP32-non-zero gradient elements are zero in the target (flushed, as
  ``measures.underflowing_params``) *and* its weights move less than ``STALL_RATIO`` of the distance they move in
  FP32: the per-parameter form of the loss stall, which needs no loss progress from FP32.
* ``custom_function_dtype``: backward raised inside a custom ``autograd.Function`` with a dtype error: its backward
  received FP16 tensors under autocast next to FP32 ones.
* ``device_limited``: the target raised because the device has no FP16 kernel for an op (``kernel_limit``).
* ``probe_on_flagged_batch``: the raw FP16 probe's first fault falls on a batch the data scan flagged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ampdoctor.judge import locate
from ampdoctor.judge.datascan import DataIssue
from ampdoctor.judge.thresholds import STALL_RATIO
from ampdoctor.records import StageError, StageResult, StepStats


@dataclass(frozen=True)
class LossFault:
    step: int
    loss: float


def loss_fault(res: StageResult, step: int, st: StepStats | None) -> LossFault | None:
    """The loss of ``step`` is non-finite while every module output of that step is finite."""
    if st is None or step >= len(res.records):
        return None
    loss = res.records[step].loss
    if math.isfinite(loss) or locate.forward_fault(st):
        return None
    return LossFault(step, loss)


@dataclass(frozen=True)
class Frozen:
    param: str
    module: str
    flushed: float
    """Median share of FP32-non-zero gradient elements that are zero in the target."""
    moved: float
    """Target's weight movement ‖w_end − w_0‖ as a share of FP32's over the same steps."""
    decayed: bool = False
    """Under weight decay, flushed at every step of the run: the decay moves it as far as in FP32, not learning."""


def frozen_params(target: StageResult, fp32: StageResult, underflowing: list[tuple[str, float]],
                  throughout: list[tuple[str, float]] | None = None) -> list[Frozen]:
    """Parameters from ``underflowing`` (already in backward order) that barely move against FP32.

    Weight decay moves every weight, learning or not, in both stages alike, so for a parameter under decay the
    movement cannot tell a frozen one: there, a gradient more than half flushed over the whole run
    (``throughout``: the median over every step, as ``underflowing_params`` over all steps) is the freeze."""
    if not target.moved or not fp32.moved or len(target.records) != len(fp32.records) or target.stopped:
        return []
    whole = dict(throughout or [])
    names = list(dict.fromkeys([p for p, _ in underflowing] + [p for p in whole if p in target.weight_decay]))
    flushed = dict(underflowing)
    out = []
    for p in names:
        d32, dt = fp32.moved.get(p), target.moved.get(p)
        if d32 is None or dt is None or not d32 > 0 or not math.isfinite(dt):
            continue
        module = p.rsplit(".", 1)[0] if "." in p else locate.MODEL
        if dt < STALL_RATIO * d32:
            out.append(Frozen(p, module, flushed.get(p, whole.get(p, 0.0)), dt / d32))
        elif p in target.weight_decay and p in whole:
            out.append(Frozen(p, module, whole[p], dt / d32, decayed=True))
    if throughout and target.stats:  # both lists are in backward order: keep it across them
        rank = {m: i for i, m in enumerate(locate.backward_order(target.stats[0]))}
        out.sort(key=lambda f: rank.get(f.module, 1 << 30))
    return out


@dataclass(frozen=True)
class CustomFunctionDtype:
    function: str
    module: str | None


_DTYPE_WORDS = ("dtype", "scalar type", "Half", "BFloat16", "c10::Half")


def custom_function_dtype(err: StageError) -> CustomFunctionDtype | None:
    """A dtype error raised in the backward of a custom autograd.Function."""
    if err.custom_function is None or not any(w in err.message for w in _DTYPE_WORDS):
        return None
    return CustomFunctionDtype(err.custom_function, err.module)


_NO_HALF_KERNEL = "not implemented for 'Half'"


_CPU_KERNEL_WORDS = ("primitive descriptor", "oneDNN")


KernelLimit = Literal["onednn_fp16", "no_half_kernel"]
"""A kernel the device lacks: oneDNN's FP16 primitive on the CPU (under amp or raw FP16), or torch's FP16 kernel."""


def kernel_limit(message: str, stage: str, device: str) -> KernelLimit | None:
    """The kernel an exception's message (torch's own words) says the device lacks, or None when it says no such thing."""
    if device.split(":")[0] == "cpu" and stage in ("amp", "fp16") and any(w in message for w in _CPU_KERNEL_WORDS):
        return "onednn_fp16"
    return "no_half_kernel" if _NO_HALF_KERNEL in message else None


def device_limited(err: StageError, stage: str, device: str) -> bool:
    """The target raised because the device has no FP16 kernel for an op (``kernel_limit``): a limit of the device,
    not a NaN cause (verdict ``inconclusive``)."""
    return kernel_limit(err.message, stage, device) is not None


def probe_on_flagged_batch(step: int, batch_of: Callable[[int], int], issues: list[DataIssue]) -> list[DataIssue]:
    """Data issues that explain the raw FP16 probe's first failure at ``step``: issues of that
    step's batch that no earlier step's batch also holds (the probe got through those)."""
    b = batch_of(step)
    earlier = {batch_of(s) for s in range(step)}
    return [d for d in issues if b in d.batches and not earlier & set(d.batches)]
