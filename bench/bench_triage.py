"""Wall time of `ampdoctor triage` against the same stages' steps run bare (no hooks, no diagnosis).

    python bench/bench_triage.py [--repeats 5] [--steps 50] [--device cpu] [--specs a.py,b.py]

Interleaved (triage, bare, triage, bare, ...) in one process; medians and the ratio per sample.
Spec loading and batch materialisation are done once and excluded from both sides.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ampdoctor.engine.recheck import recheck_fn
from ampdoctor.engine.stages import StageContext, run_stage
from ampdoctor.engine.triage import prepare, user_hooks
from ampdoctor.input.batches import Batches
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.env import resolve_device
from ampdoctor.input.spec import Spec, load_spec
from ampdoctor.judge.rules import diagnose

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ["healthy.py", "forward_overflow.py", "grad_overflow.py", "amp_misuse.py", "grad_underflow.py"]


def run_stages(spec: Spec, model: torch.nn.Module, batches: Batches, init: dict[str, torch.Tensor], cfg: TriageConfig,
               device: torch.device, monitored: bool) -> None:
    """The stages as triage runs them (monitored: hooks, statistics, re-check, diagnosis) or bare."""
    results = {}
    for name in cfg.stage_list():
        ctx = StageContext(spec, model, init, batches, cfg, device, with_monitor=monitored, snapshot=monitored and name == cfg.target)
        results[name] = run_stage(name, ctx)
    if monitored:
        diagnose(results, batches, cfg, recheck_fn(model, spec, batches, init, results, device), str(device), user_hooks(model))


def run(spec_path: Path, cfg: TriageConfig, monitored: bool) -> float:
    device = resolve_device(cfg.device)
    spec = load_spec(spec_path)
    model, batches = prepare(spec, cfg, device)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    run_stages(spec, model, batches, init, cfg, device, monitored)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--specs", default=",".join(SAMPLES), help="comma-separated sample names or spec paths")
    a = ap.parse_args()
    cfg = TriageConfig(steps=a.steps, device=a.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {a.device}, {a.steps} steps x stages {cfg.stage_list()}")
    print(f"{'sample':24} {'bare s':>8} {'triage s':>9} {'ratio':>6}")
    for name in a.specs.split(","):
        path = Path(name) if Path(name).exists() else ROOT / "sample_models" / name
        run(path, cfg, True)  # warm-up
        bare, full = [], []
        for _ in range(a.repeats):
            full.append(run(path, cfg, True))
            bare.append(run(path, cfg, False))
        b, f = statistics.median(bare), statistics.median(full)
        print(f"{name:24} {b:8.3f} {f:9.3f} {f / b:6.2f}")


if __name__ == "__main__":
    main()
