"""``ampdoctor triage SPEC --target fp8``: the FP8 ladder, its verdict, the terminal report and ``--json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from ampdoctor.errors import UsageError
from ampdoctor.input.spec import SpecNames, call_user, importable, load_spec

UNSUPPORTED = ("--from", "--checkpoint", "--report", "--dump-dir", "--log", "--nproc", "--script", "--stages")


def triage_fp8(spec: Path | None, names: SpecNames, recipe: str, steps: int | None, seed: int | None, device: str,
               json_path: Path | None, quiet: bool, human: Console, given: dict[str, Any]) -> int:
    """Run the FP8 ladder on ``spec`` and show its report; returns the exit code."""
    import torch

    from ampdoctor.engine.fp8 import RECIPES, run_ladder
    from ampdoctor.input.batches import materialise
    from ampdoctor.input.env import resolve_device
    from ampdoctor.judge.fp8 import judge
    from ampdoctor.render.fp8 import render, to_json
    from ampdoctor.report.fp8 import build

    used = [flag for flag, v in given.items() if v]
    if used:
        raise UsageError(f"{used[0]} does not work with --target fp8 yet; leave it out")
    if recipe not in RECIPES:
        raise UsageError(f"--fp8-recipe must be one of {', '.join(RECIPES)} (got {recipe!r})")
    if spec is None:
        raise UsageError("--target fp8 needs SPEC.py (build_model() and build_dataloader())")
    with importable(spec):
        sp = load_spec(spec, names)
        n = int(steps if steps is not None else sp.options.get("steps", 50))
        s = int(seed if seed is not None else sp.options.get("seed", 0))
        if n < 4:
            raise UsageError(f"--steps must be at least 4 with --target fp8 (got {n})")
        dev = resolve_device(device)
        torch.manual_seed(s)
        model = call_user(sp.build_model, what="build_model()", path=sp.path).to(dev)
        batches = materialise(call_user(sp.build_dataloader, what="build_dataloader()", path=sp.path), n)
        lad = run_ladder(sp, model, batches, n, recipe=recipe, device=dev, seed=s)
    report = build(judge(lad), lad)
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
