"""The FP8 ladder: the rungs ``fp32``, ``bf16`` and ``fp8`` (``ladder.fp8``: BF16 autocast with the model's Linear
layers converted to torchao's ``Float8Linear``), from the same weights on the same batches.

Every rung runs the one step recipe (``engine.step.TrainStep`` through ``engine.driver.Driver``) under its ``Rung``;
the FP8 rung differs from the BF16 one only by its model (the rung's transform: a converted copy, whose FP32 weights
its optimizer trains) and by a ``watch.fp8.GemmObserver`` reading each GEMM's operands. ``judge.fp8`` reads the
result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampdoctor.engine.driver import Driver
from ampdoctor.engine.forward import make_optimizer
from ampdoctor.engine.step import TrainStep
from ampdoctor.errors import SpecError, UsageError
from ampdoctor.input.batches import Batches
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.spec import Spec
from ampdoctor.judge.fp8 import Fp8Ladder, RungRun
from ampdoctor.ladder import Rung, rung
from ampdoctor.ladder.fp8 import LADDER, RECIPES, fp8_kernels
from ampdoctor.watch.fp8 import GemmObserver, recipe_of

__all__ = ["LADDER", "RECIPES", "run_ladder"]


def _run_rung(r: Rung, run_model: nn.Module, spec: Spec, batches: Batches, steps: int, device: torch.device,
              seed: int) -> RungRun:
    res = RungRun(r.name)
    torch.manual_seed(seed)
    opt = make_optimizer(spec.build_optimizer, run_model)
    recipe = TrainStep(run_model, opt, None, precision=r, skip_nonfinite=False)
    driver = Driver(recipe, spec.loss_fn, device, check_weights=True)
    obs = GemmObserver(run_model)
    res.recipe = recipe_of(run_model)
    run_model.train()
    try:
        with obs:
            for step in range(steps):
                obs.begin(step)
                done = driver.step(step, batches[step])
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


def run_ladder(spec: Spec, model: nn.Module, batches: Batches, steps: int, *, recipe: str = "tensorwise",
               device: torch.device | None = None, seed: int = 0) -> Fp8Ladder:
    """The rungs ``LADDER`` (fp32, bf16, fp8 under ``recipe``) from ``model``'s current weights on ``batches``.
    ``model`` is FP32 and left as it was given; the FP8 rung trains a converted copy."""
    dev = device or next(model.parameters()).device
    config = TriageConfig(steps=steps, seed=seed, stages=("fp32", "bf16"), fp8_recipe=recipe)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rungs: dict[str, RungRun] = {}
    try:
        for name in LADDER:
            r = rung(name, config)
            model.load_state_dict(init)
            rungs[name] = _run_rung(r, r.cast_model(model, dev), spec, batches, steps, dev, seed)
    finally:
        model.load_state_dict(init)
        model.zero_grad(set_to_none=True)
    return Fp8Ladder(rungs, recipe, dev.type, not fp8_kernels(dev))


def describe(lad: Fp8Ladder) -> dict[str, Any]:
    """The ladder's rungs as plain data (for the report)."""
    return {"rungs": list(lad.rungs), "recipe": lad.recipe, "emulated": lad.emulated}
