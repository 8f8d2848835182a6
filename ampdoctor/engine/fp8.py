"""The FP8 ladder: FP32, BF16 autocast, then BF16 autocast with the model's Linear layers converted to torchao's
``Float8Linear``, from the same weights on the same batches.

Every rung runs the one step recipe (``engine.step.TrainStep`` through ``engine.driver.Driver``); the FP8 rung
differs from the BF16 one only by its model (``Float8Transform``: a converted copy, emulated off a GPU that
has FP8 kernels) and by a ``watch.fp8.GemmObserver`` reading each GEMM's operands. ``judge.fp8`` reads the
result. torchao is an optional extra: without it ``Float8Transform.apply`` raises one ``UsageError`` line.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.engine.driver import Driver
from ampdoctor.engine.step import BF16, FP32, Precision, TrainStep, make_optimizer
from ampdoctor.errors import SpecError, UsageError
from ampdoctor.input.batches import Batches
from ampdoctor.input.spec import Spec
from ampdoctor.judge.fp8 import Fp8Ladder, RungRun
from ampdoctor.watch.fp8 import GemmObserver, recipe_of

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao 0.18's ``Float8LinearRecipeName`` values (``--fp8-recipe``)."""

INSTALL = "FP8 needs torchao: pip install 'ampdoctor[fp8]' (torchao 0.18)"


def fp8_kernels(device: torch.device) -> bool:
    """Whether ``device`` runs FP8 GEMMs natively (CUDA compute capability 8.9 or newer); else torchao emulates."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass
class Float8Transform:
    """The FP8 rung's model transform (``name``/``apply``/``describe``): a copy of the model with its
    ``nn.Linear`` layers converted by ``torchao.float8.convert_to_float8_training`` under ``recipe``;
    ``skip``: module names kept in high precision (what a ``module_filter_fn`` would exclude)."""

    recipe: str = "tensorwise"
    skip: tuple[str, ...] = ()
    emulate: bool | None = None
    """None: emulate unless the device has FP8 kernels."""

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
        return {"transform": self.name, "recipe": self.recipe, "skip": list(self.skip), "emulate": self.emulate}


def _run_rung(name: str, prec: Precision, run_model: nn.Module, spec: Spec, batches: Batches, steps: int,
              device: torch.device, seed: int, observe: bool) -> RungRun:
    res = RungRun(name)
    torch.manual_seed(seed)
    opt = make_optimizer(spec.build_optimizer, run_model)
    recipe = TrainStep(run_model, opt, None, precision=prec, skip_nonfinite=False)
    driver = Driver(recipe, spec.loss_fn, device, check_weights=True)
    obs = GemmObserver(run_model) if observe else None
    if obs is not None:
        res.recipe = recipe_of(run_model)
    run_model.train()
    try:
        with obs if obs is not None else _nothing():
            for step in range(steps):
                if obs is not None:
                    obs.begin(step)
                done = driver.step(step, batches[step])
                if obs is not None:
                    res.gemms.extend(obs.end_step())
                res.losses.append(done.record.loss)
                res.grad_norms.append(done.record.grad_l2_pre_clip)
                res.stopped = driver.stop_of(done.record)
                if res.stopped is not None:
                    break
    except (UsageError, SpecError):
        raise
    except Exception as e:  # the user's model under this rung raised: the rung's error, not ampdoctor's
        res.error = f"{type(e).__name__}: {str(e).strip()[:200]}"
    return res


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run_ladder(spec: Spec, model: nn.Module, batches: Batches, steps: int, *, recipe: str = "tensorwise",
               device: torch.device | None = None, seed: int = 0, skip: tuple[str, ...] = ()) -> Fp8Ladder:
    """FP32, BF16 autocast and BF16 + Float8Linear (``recipe``) from ``model``'s current weights on ``batches``.
    ``model`` is FP32 and left as it was given; the FP8 rung trains a converted copy."""
    dev = device or next(model.parameters()).device
    transform = Float8Transform(recipe, skip)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rungs: dict[str, RungRun] = {}
    try:
        for name, prec in (("fp32", FP32), ("bf16", BF16)):
            model.load_state_dict(init)
            rungs[name] = _run_rung(name, prec, model, spec, batches, steps, dev, seed, observe=False)
        model.load_state_dict(init)
        fp8_model = transform.apply(model, dev)
        rungs["fp8"] = _run_rung("fp8", dataclasses.replace(BF16, name="fp8"), fp8_model, spec, batches, steps, dev,
                                 seed, observe=True)
    finally:
        model.load_state_dict(init)
        model.zero_grad(set_to_none=True)
    return Fp8Ladder(rungs, recipe, dev.type, not fp8_kernels(dev))
