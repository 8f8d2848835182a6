"""Where a full Monitor step of the deep MLP spends its time, phase by phase, against a bare step and a Monitor
without statistics ("monitor only"): the three stepped in turn (order alternated each round), this thread's
CPU time, one torch thread. Each phase is the CPU time inside one function, summed over the step and
averaged over the rounds; "forward" is the model call and the loss, "backward" every ``Tensor.backward``.

    python bench/phases_deep_mlp.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import deep_mlp, loss_fn  # noqa: E402

from ampdoctor import Monitor  # noqa: E402
from ampdoctor.engine import ring as engine_ring  # noqa: E402
from ampdoctor.engine import step as engine_step  # noqa: E402
from ampdoctor.watch import fused  # noqa: E402
from ampdoctor.watch import hooks as watch_hooks  # noqa: E402
from ampdoctor.watch import stats as watch_stats  # noqa: E402

CLOCK = time.thread_time
ACC: collections.defaultdict[str, float] = collections.defaultdict(float)


def timed(owner: Any, name: str, label: str) -> None:
    f: Callable[..., Any] = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = CLOCK()
        try:
            return f(*a, **k)
        finally:
            ACC[label] += CLOCK() - t

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    fused.build_now()
    timed(torch.Tensor, "backward", "backward")
    timed(watch_hooks.Hooks, "after_backward", "hooks.after_backward (parameter gradients queued)")
    timed(watch_hooks.Hooks, "end_step", "hooks.end_step (reductions left, the host copy, the rows)")
    timed(watch_stats.StatsBuffer, "collect", "  of which StatsBuffer.collect")
    timed(engine_step.TrainStep, "measure", "recipe.measure (norms, the host copy, the skip decision)")
    timed(engine_step.TrainStep, "apply", "recipe.apply (optimizer step, scaler.update)")
    timed(engine_ring.Lookback, "push", "lookback ring push")
    timed(engine_ring.RingFigures, "__call__", "ring figures (per-parameter, Adam's state every 16th)")
    base, batch = deep_mlp()
    g = torch.Generator().manual_seed(0)

    def make(kind: str) -> tuple[Any, ...]:
        m = copy.deepcopy(base)
        o = torch.optim.AdamW(m.parameters(), lr=1e-4)
        s = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        every = 10**9 if kind == "monitor only" else 1
        mon = (Monitor(m, o, s, every=every, keep_stats=False, alert_min_steps=10**9, quiet=True)
               if kind != "bare" else None)
        return kind, m, o, s, mon

    def step(v: tuple[Any, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        _, m, o, s, mon = v
        t = CLOCK()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(m(x), y)
        ACC["forward"] += CLOCK() - t
        if mon is not None:
            mon.step(loss)
            return
        s.scale(loss).backward()
        s.unscale_(o)
        s.step(o)
        s.update()
        o.zero_grad(set_to_none=True)

    variants = [make(k) for k in ("bare", "full", "monitor only")]
    batches = [batch(g) for _ in range(4)]
    for v in variants:
        for x, y in batches[:2]:
            step(v, x, y)
    totals: dict[str, list[float]] = collections.defaultdict(list)
    phases: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for r in range(a.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            x, y = batches[r % 4]
            ACC.clear()
            t = CLOCK()
            step(v, x, y)
            totals[v[0]].append(CLOCK() - t)
            for k, val in ACC.items():
                phases[v[0]][k] += val
    print(f"deep MLP, {a.rounds} rounds, load average {os.getloadavg()[0]:.1f}; ms per step")
    bare = totals["bare"]
    for kind in ("bare", "full", "monitor only"):
        ratio = statistics.median(t / b for t, b in zip(totals[kind], bare, strict=True))
        print(f"{kind:14} median {statistics.median(totals[kind]) * 1e3:7.2f}  paired {ratio:.3f}")
        for label, val in sorted(phases[kind].items()):
            print(f"    {label:60} {val / a.rounds * 1e3:7.2f}")


if __name__ == "__main__":
    main()
