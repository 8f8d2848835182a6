"""What Python's cyclic garbage collector costs a monitored step (issue 14).

    python bench/bench_gc.py [--models deep_mlp] [--variants "bare,ampdoctor full,ampdoctor sentinel"] [--steps 20]

Per variant (bench_overhead's, one process each in turn, one torch thread): the collections of each
generation during ``--steps`` steps after a warm-up, counted with ``gc.callbacks``, their time per step
and the longest one. A full (generation 2) collection walks every tracked object of the process, over
300,000 with torch loaded, so a monitor that makes objects which outlive a young collection pays
about 130 ms every few dozen steps: invisible in a median step time, not in a run's wall time.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import Variant  # noqa: E402
from models import MODELS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="deep_mlp")
    ap.add_argument("--variants", default="bare,ampdoctor full,ampdoctor sentinel")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {a.steps} steps per variant after 3 warm-up steps")
    for mname in a.models.split(","):
        torch.manual_seed(0)
        model, make_batch = MODELS[mname]()
        g = torch.Generator().manual_seed(0)
        batches = [make_batch(g) for _ in range(4)]
        print(f"\n{mname}: {len(gc.get_objects()):,} objects tracked by the collector")
        print(f"  {'variant':24} {'gen0/step':>9} {'gen1/step':>9} {'gen2/step':>9} {'gc ms/step':>10} {'longest ms':>10} {'step ms':>8}")
        for name in a.variants.split(","):
            v = Variant(name, model, torch.device("cpu"))
            for i in range(3):
                v.step(*batches[i % 4])
            counts = [0, 0, 0]
            spent: list[float] = []
            start: dict[str, float] = {}

            def cb(phase: str, info: dict[str, Any], counts: list[int] = counts, spent: list[float] = spent,
                   start: dict[str, float] = start) -> None:
                if phase == "start":
                    start["t"] = time.perf_counter()
                else:
                    counts[info["generation"]] += 1
                    spent.append(time.perf_counter() - start["t"])

            gc.callbacks.append(cb)
            t0 = time.perf_counter()
            for i in range(a.steps):
                v.step(*batches[i % 4])
            total = time.perf_counter() - t0
            gc.callbacks.remove(cb)
            if v.monitor is not None:
                v.monitor.close()
            n = a.steps
            print(f"  {name:24} {counts[0] / n:9.2f} {counts[1] / n:9.2f} {counts[2] / n:9.2f} {sum(spent) / n * 1e3:10.2f} "
                  f"{max(spent, default=0.0) * 1e3:10.1f} {total / n * 1e3:8.1f}")


if __name__ == "__main__":
    main()
