"""The lookback ring's Adam figures over the deep MLP's state: torch's passes (``engine.ring.adam_figures``) against
the one C++ pass (``fused.fused_adam``); medians of 30 calls each, this thread's CPU time, one torch thread.

    python bench/bench_adam_figures.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import deep_mlp  # noqa: E402

from ampdoctor.engine.ring import adam_chunks, adam_figures  # noqa: E402
from ampdoctor.watch import fused  # noqa: E402


def median_ms(f: Callable[[], Any], n: int = 30) -> float:
    ts = []
    for _ in range(n):
        t = time.thread_time()
        f()
        ts.append(time.thread_time() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    fused.build_now()
    model, _ = deep_mlp()
    g = torch.Generator().manual_seed(0)
    ms = [torch.randn(p.shape, generator=g) for p in model.parameters()]
    vs = [torch.rand(p.shape, generator=g) * 1e-6 for p in model.parameters()]
    cpu = torch.device("cpu")
    chunks = adam_chunks(ms, vs, [0] * len(ms), cpu)
    print(f"{len(ms)} state tensors, {sum(m.numel() for m in ms):,} elements")
    print(f"torch passes  {median_ms(lambda: adam_figures(len(ms), chunks, [1e-8], cpu)):7.2f} ms")
    print(f"one C++ pass  {median_ms(lambda: fused.fused_adam(ms, vs, [1e-8] * len(ms))):7.2f} ms")


if __name__ == "__main__":
    main()
