"""A rung of the precision ladder: how a step computes, as data.

A rung names its compute dtype (the autocast dtype), the dtype of the weights the forward runs, whether FP32
master weights take the update, whether a GradScaler scales the loss, and the model transform that makes the
model the forward runs (none; torchao's FP8 conversion; ``torch.compile``). The triage stages, the Monitor's
view of the user's own loop and ``ampdoctor layers`` all run ``engine.step.TrainStep`` under one ``Rung``.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ampdoctor.ladder.policy import autocast_context


@runtime_checkable
class ModelTransform(Protocol):
    """What turns the FP32 model (already cast to the rung's weight dtype) into the model the forward runs."""

    @property
    def name(self) -> str:
        """'none', 'compile:inductor', 'float8:tensorwise', ...: the manifest's and the report's name for it."""
        ...

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The model the forward runs. A transform that changes the model returns a changed copy, never the
        FP32 model it was handed changed in place (triage resets that model before every rung)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Plain data (str, int, float, bool, lists and dicts of them) for the manifest and the report."""
        ...


@dataclass(frozen=True)
class NoTransform:
    """The model runs as it is."""

    name: str = "none"

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


NONE = NoTransform()


@dataclass(frozen=True)
class Rung:
    """How a step computes.

    ``compute``: the autocast dtype (None: no autocast). ``params``: the dtype of the weights the model runs
    with. ``master``: an FP32 master copy takes the optimizer's update (the low-precision weights are copied
    from it after each step); without it the optimizer steps the low-precision weights themselves.
    ``scaler``: the loss goes through a GradScaler. ``transform``: what makes the model the forward runs.
    """

    name: str
    compute: torch.dtype | None = None
    params: torch.dtype = torch.float32
    master: bool = True
    scaler: bool = False
    transform: ModelTransform = field(default=NONE)

    @classmethod
    def for_autocast(cls, dtype: torch.dtype | None, scaler: bool) -> Rung:
        """The rung of a loop that runs FP32 weights under ``torch.autocast(dtype)`` (None: no autocast), with
        or without a GradScaler: the user's own loop as the Monitor sees it."""
        name = "amp" if dtype == torch.float16 else "bf16" if dtype == torch.bfloat16 else "fp32"
        return cls(name, compute=dtype, scaler=scaler)

    @property
    def low_weights(self) -> bool:
        """The forward runs weights in a dtype other than FP32 (a cast copy of the model)."""
        return self.params != torch.float32

    def autocast_on(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` with this rung's compute dtype on ``device`` (disabled without one); CUDA's op policy
        emulated on the CPU inside ``ladder.policy.using(..."cuda"...)``."""
        return autocast_context(device, self.compute)

    def cast_model(self, model: nn.Module, device: torch.device | None = None) -> nn.Module:
        """The model this rung's forward runs: a copy in the rung's weight dtype (the model itself in FP32), then
        the rung's transform (on ``device``, by default the model's)."""
        run = copy.deepcopy(model).to(self.params) if self.low_weights else model
        if self.transform is NONE:
            return run
        if device is None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        return self.transform.apply(run, device)

    def describe(self) -> dict[str, Any]:
        """Plain data for the manifest and the report."""
        return {"name": self.name, "compute": str(self.compute).removeprefix("torch.") if self.compute else None,
                "params": str(self.params).removeprefix("torch."), "master": self.master, "scaler": self.scaler,
                "transform": self.transform.describe()}
