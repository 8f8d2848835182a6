"""The first minutes of a Monitor on a machine without a built kernel: how long until the kernel is ready, and
what the steps cost meanwhile.

One process, a fresh extension cache (a temporary TORCH_EXTENSIONS_DIR, so the kernel really is built: in a
child process, as a user's first Monitor starts it), the deep MLP (128 x Linear(64,64) -> LayerNorm -> GELU,
batch 32), AdamW, autocast fp16 + GradScaler, one torch thread. Three variants stepped in turn: bare; a full
Monitor as users get it (sentinel checks only while the kernel builds, full statistics once it is ready); and a
full Monitor with ``AMPDOCTOR_WARMUP=full`` (full statistics on the eager path meanwhile, the old behaviour).
Each step is timed in this thread's CPU time (the builder's CPU is its own process's), and the ratios are the
median over rounds of the monitored step over the bare step of the same round, before and after the kernel
became ready.

    python bench/bench_first_minutes.py                 # until ready, then --after rounds more
    python bench/bench_first_minutes.py --ext /tmp/ext  # keep (or reuse) the build there
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ext", default=None, help="TORCH_EXTENSIONS_DIR to build in (default: a fresh temporary one)")
    ap.add_argument("--after", type=int, default=30, help="Rounds after the kernel is ready.")
    ap.add_argument("--max-seconds", type=float, default=900.0)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ampdoctor-ext-") if args.ext is None else args.ext
    os.environ["TORCH_EXTENSIONS_DIR"] = tmp
    import torch

    torch.set_num_threads(1)
    from models import deep_mlp, loss_fn

    from ampdoctor import Monitor
    from ampdoctor.watch import fused

    base, batch = deep_mlp()
    g = torch.Generator().manual_seed(0)
    variants: dict[str, dict[str, Any]] = {}
    t_start = time.monotonic()
    for name, warm in (("bare", None), ("full Monitor", "sentinel"), ("full Monitor, AMPDOCTOR_WARMUP=full", "full")):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        mon = None
        if warm is not None:
            os.environ["AMPDOCTOR_WARMUP"] = warm
            mon = Monitor(model, opt, scaler, keep_stats=False, alert_min_steps=10**9, quiet=True)
        variants[name] = {"model": model, "opt": opt, "scaler": scaler, "mon": mon, "before": [], "after": []}
    ready_at: float | None = None
    rounds_before = 0
    after = 0
    while after < args.after and time.monotonic() - t_start < args.max_seconds:
        ready = fused._state["module"] is not None
        if ready and ready_at is None:
            ready_at = time.monotonic() - t_start
        x, y = batch(g)
        for v in variants.values():
            model, opt, scaler, mon = v["model"], v["opt"], v["scaler"], v["mon"]
            t0 = time.thread_time()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            if mon is not None:
                mon.step(loss)
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            v["after" if ready else "before"].append(time.thread_time() - t0)
        if ready:
            after += 1
        else:
            rounds_before += 1
    print(f"machine: {os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, "
          f"one torch thread; cache {tmp}")
    print(f"kernel ready {ready_at:.1f} s after the first Monitor()" if ready_at is not None else
          f"kernel not ready after {args.max_seconds:.0f} s")
    bare = variants["bare"]
    for phase in ("before", "after"):
        n = len(bare[phase])
        if not n:
            continue
        label = f"while the kernel builds ({n} rounds)" if phase == "before" else f"once it is ready ({n} rounds)"
        print(label + f": bare step {statistics.median(bare[phase]) * 1e3:.1f} ms CPU")
        for name, v in variants.items():
            if name == "bare":
                continue
            ratios = [a / b for a, b in zip(v[phase], bare[phase], strict=True)]
            q = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [min(ratios), 0, max(ratios)]
            print(f"  {name}: paired {statistics.median(ratios):.3f}x (quartiles {q[0]:.3f}-{q[2]:.3f}), "
                  f"median step {statistics.median(v[phase]) * 1e3:.1f} ms")
    for v in variants.values():
        if v["mon"] is not None:
            v["mon"].close()


if __name__ == "__main__":
    main()
