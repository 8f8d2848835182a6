"""``ampdoctor triage SPEC --target fp8``: the FP8 ladder, its verdict, the terminal report and ``--json``; with
``--from CAPTURE``, the ladder from a Monitor's capture of a converted model (its recipe from the manifest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from ampdoctor.errors import UsageError
from ampdoctor.input.batches import Batches
from ampdoctor.input.spec import Spec, SpecNames, call_user, importable, load_spec


def _fresh(sp: Spec, steps: int, seed: int, dev: torch.device) -> tuple[nn.Module, Batches, int]:
    from ampdoctor.input.batches import materialise

    if steps < 4:
        raise UsageError(f"--steps must be at least 4 with --target fp8 (got {steps})")
    torch.manual_seed(seed)
    model = call_user(sp.build_model, what="build_model()", path=sp.path).to(dev)
    return model, materialise(call_user(sp.build_dataloader, what="build_dataloader()", path=sp.path), steps), steps


def _replay(sp: Spec, capture: Path, dev: torch.device) -> tuple[Spec, nn.Module, Batches, int, int, str | None]:
    """The captured weights and batches (``engine.triage.prepare_replay``), the steps they cover, the run's step
    of the first, and the recipe the capture recorded (None: a capture of a model not converted)."""
    from ampdoctor.engine.triage import prepare_replay
    from ampdoctor.input.config import TriageConfig

    sp, model, batches, cap, _ = prepare_replay(sp, TriageConfig(device=str(dev)), dev, capture)
    m = cap.manifest
    casts = (m.get("fp8") or {}).get("casts") or {}
    recipe = None if not casts else "rowwise" if str(casts.get("input", "")).endswith("/rowwise") else "tensorwise"
    steps = max(1, len(batches.items))
    first = int(m.get("step", 0)) - (steps - 1)
    return sp, model, batches, steps, first, recipe


def triage_fp8(spec: Path | None, names: SpecNames, recipe: str | None, steps: int | None, seed: int | None, device: str,
               json_path: Path | None, quiet: bool, human: Console, given: dict[str, Any],
               from_capture: Path | None = None) -> int:
    """Run the FP8 ladder on ``spec`` (or from ``from_capture``) and show its report; returns the exit code."""
    from ampdoctor.engine.fp8 import RECIPES, run_ladder
    from ampdoctor.input.env import resolve_device
    from ampdoctor.judge.fp8 import judge
    from ampdoctor.render.fp8 import render, to_json
    from ampdoctor.report.fp8 import build

    used = [flag for flag, v in given.items() if v]
    if used:
        raise UsageError(f"{used[0]} does not work with --target fp8 yet; leave it out")
    if recipe is not None and recipe not in RECIPES:
        raise UsageError(f"--fp8-recipe must be one of {', '.join(RECIPES)} (got {recipe!r})")
    if spec is None:
        raise UsageError("--target fp8 needs SPEC.py (build_model() and build_dataloader())")
    dev = resolve_device(device)
    with importable(spec):
        sp = load_spec(spec, names, require_data=from_capture is None)
        s = int(seed if seed is not None else sp.options.get("seed", 0))
        first = 0
        if from_capture is not None:
            sp, model, batches, n, first, recorded = _replay(sp, from_capture, dev)
            recipe = recipe or recorded
        else:
            model, batches, n = _fresh(sp, int(steps if steps is not None else sp.options.get("steps", 50)), s, dev)
        recipe = recipe or str(sp.options.get("fp8_recipe", "tensorwise"))
        lad = run_ladder(sp, model, batches, n, recipe=recipe, device=dev, seed=s)
    report = build(judge(lad), lad, first)
    if json_path is not None:
        text = to_json(report)
        if str(json_path) == "-":
            print(text)
        else:
            json_path.write_text(text + "\n")
    if quiet:
        human.print(f"{report.cause} module={report.module} operand={report.operand} step={report.step} stage={report.stage}",
                    highlight=False, markup=False)
    else:
        render(report, human)
    return report.exit_code
