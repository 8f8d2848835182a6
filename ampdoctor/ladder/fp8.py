"""The FP8 rung: BF16 autocast with the model's ``nn.Linear`` layers converted to torchao's ``Float8Linear``.

``Float8Transform`` is the rung's model transform: a copy of the model converted by
``torchao.float8.convert_to_float8_training`` under the recipe (``TriageConfig.fp8_recipe``), emulated off a
GPU with FP8 kernels. torchao is an optional extra (``ampdoctor[fp8]``): without it ``apply`` raises one
``UsageError`` line saying how to install it. The rung is registered as ``fp8``; ``engine.fp8`` runs it after
``fp32`` and ``bf16`` (``--target fp8``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import UsageError
from ampdoctor.input.config import TriageConfig
from ampdoctor.ladder.registry import register
from ampdoctor.ladder.rung import Rung

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao 0.18's ``Float8LinearRecipeName`` values (``--fp8-recipe``)."""

INSTALL = "FP8 needs torchao: pip install 'ampdoctor[fp8]' (torchao 0.18)"


def fp8_kernels(device: torch.device) -> bool:
    """Whether ``device`` runs FP8 GEMMs natively (CUDA compute capability 8.9 or newer); else torchao emulates."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass(frozen=True)
class Float8Transform:
    """A copy of the model with its ``nn.Linear`` layers converted under ``recipe``; ``skip``: module names kept in
    high precision (what a ``module_filter_fn`` excludes); ``emulate`` None: unless the device has FP8 kernels."""

    recipe: str = "tensorwise"
    skip: tuple[str, ...] = ()
    emulate: bool | None = None

    @property
    def name(self) -> str:
        return f"float8:{self.recipe}"

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        if self.recipe not in RECIPES:
            raise UsageError(f"--fp8-recipe must be one of {', '.join(RECIPES)} (got {self.recipe!r})")
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError:
            raise UsageError(INSTALL) from None
        emulate = not fp8_kernels(device) if self.emulate is None else self.emulate
        cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe), emulate=emulate)
        skip = set(self.skip)
        out: nn.Module = convert_to_float8_training(copy.deepcopy(model), config=cfg,
                                                    module_filter_fn=lambda m, fqn: fqn not in skip)
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "recipe": self.recipe, "skip": list(self.skip), "emulate": self.emulate}


def fp8(config: TriageConfig) -> Rung:
    """BF16 autocast, FP32 weights, the Linear layers converted under the config's recipe."""
    return Rung("fp8", compute=torch.bfloat16, transform=Float8Transform(config.fp8_recipe))


register("fp8", fp8)

LADDER = ("fp32", "bf16", "fp8")
"""The rungs ``--target fp8`` runs, in order."""
