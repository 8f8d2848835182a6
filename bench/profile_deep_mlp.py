"""Where a full Monitor step of the deep MLP spends its time: bare and full steps in turn (this thread's CPU time,
one torch thread), then cProfile over 15 full steps, by internal time. Builds the kernel first (blocking).

    python bench/profile_deep_mlp.py
"""

from __future__ import annotations

import copy
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import deep_mlp, loss_fn  # noqa: E402

from ampdoctor import Monitor  # noqa: E402
from ampdoctor.watch import fused  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    fused.build_now()
    base, batch = deep_mlp()
    g = torch.Generator().manual_seed(0)

    def make(watched: bool) -> tuple[Any, ...]:
        m = copy.deepcopy(base)
        o = torch.optim.AdamW(m.parameters(), lr=1e-4)
        s = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        mon = Monitor(m, o, s, keep_stats=False, alert_min_steps=10**9, quiet=True) if watched else None
        return m, o, s, mon

    def step(v: tuple[Any, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        m, o, s, mon = v
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(m(x), y)
        if mon is not None:
            mon.step(loss)
            return
        s.scale(loss).backward()
        s.step(o)
        s.update()
        o.zero_grad(set_to_none=True)

    bare, full = make(False), make(True)
    for _ in range(3):
        x, y = batch(g)
        step(bare, x, y)
        step(full, x, y)
    tb = tw = 0.0
    for _ in range(15):
        x, y = batch(g)
        t = time.thread_time()
        step(bare, x, y)
        tb += time.thread_time() - t
        t = time.thread_time()
        step(full, x, y)
        tw += time.thread_time() - t
    print(f"bare {tb / 15 * 1e3:.1f} ms, full {tw / 15 * 1e3:.1f} ms, ratio {tw / tb:.3f}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(15):
        x, y = batch(g)
        step(full, x, y)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
