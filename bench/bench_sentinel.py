"""What the sentinel of ``Monitor(mode="sentinel")`` adds to a step, and what an exact absmax would.

    python bench/bench_sentinel.py [--models deep_mlp,gpt,word_lm] [--repeats 51] [--threads N] [--clock cpu]

Over each bench model's parameter gradients (one real backward): the per-parameter L2 norms the
monitor takes every step anyway (``_foreach_norm(ord=2)``), an exact per-tensor absmax
(``_foreach_norm(ord=inf)``), and the one host copy of the monitor's scalars without and with the
sentinel's norms appended (what sentinel mode adds). Medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, loss_fn  # noqa: E402

PACKED = torch.zeros(9, dtype=torch.float64)
"""The monitor's nine scalars of a step (loss, norms, found-inf, scale, ...)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="deep_mlp,gpt,word_lm")
    ap.add_argument("--repeats", type=int, default=51)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock {a.clock}; medians of {a.repeats}")
    for mname in a.models.split(","):
        torch.manual_seed(0)
        model, make_batch = MODELS[mname]()
        x, y = make_batch(torch.Generator().manual_seed(0))
        loss_fn(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        per = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
        fns: dict[str, Callable[[], Any]] = {
            "L2 norms (taken anyway)": lambda g=grads: torch._foreach_norm(g, 2.0, dtype=torch.float32),
            "exact absmax (ord=inf)": lambda g=grads: torch._foreach_norm(g, math.inf, dtype=torch.float32),
            "host copy, scalars only": lambda: PACKED.cpu().numpy().tolist(),
            "host copy + sentinel": lambda p=per: torch.cat([PACKED, p.to(torch.float64)]).cpu().numpy(),
        }
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(a.repeats):
            for k, fn in fns.items():
                t0 = clock()
                fn()
                times[k].append(clock() - t0)
        print(f"\n{mname}: {len(grads)} gradients, {sum(g.numel() for g in grads):,} elements")
        for k, v in times.items():
            print(f"  {k:26} {statistics.median(v) * 1e3:9.3f} ms")


if __name__ == "__main__":
    main()
