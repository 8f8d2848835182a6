"""The C++ recorder inside the deep MLP's real forward and backward (FP16 autocast, one torch thread, this thread's
CPU time): no watch at all, the ``__call__`` wrapper with an inactive recorder, the recorder taking tensor ids only,
and all of the Monitor's (ids, the training check, the activations' rows, the gradient taps). The configurations
are interleaved (order reversed every round) in one process; medians over the rounds, and each one's difference to
no watch. ``--only NAME`` runs one configuration alone (for ``perf record``: the recorder's functions by samples).

    python bench/bench_tap_forward.py [--rounds 500] [--only ids]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import deep_mlp, loss_fn  # noqa: E402

from ampdoctor.watch import calls, fused  # noqa: E402
from ampdoctor.watch import stats as watch_stats  # noqa: E402


class _Listener:  # what the wrapper holds weakly; the C function does the work
    def take_acts(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    mod = fused.build_now()
    if mod is None:
        sys.exit("the kernel cannot be built here")
    torch.manual_seed(0)
    model, make_batch = deep_mlp()
    x, y = make_batch(torch.Generator().manual_seed(0))

    def tap(acts: bool, grads: bool, active: bool, training_only: bool) -> tuple[Any, Any, bool]:
        t = mod.Tap(1 << 22, acts, grads, True, *watch_stats._thresholds(watch_stats.FP16), lambda: None)
        mod.tap_configure(t, [m for _, m in model.named_modules()], weakref.ref(model), training_only)
        return t, mod.tap_caller(t), active

    configs: dict[str, tuple[Any, Any, bool] | None] = {
        "no watch": None, "wrapper": tap(False, False, False, False), "ids": tap(False, False, True, False),
        "all": tap(True, True, True, True)}
    if a.only:
        configs = {a.only: configs[a.only]}
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in configs}
    listener = _Listener()
    clock = time.thread_time
    # (one take, or the three of a build before it: a revision from before 2026-12-04 benched the same way)
    take = getattr(mod, "tap_take", None) or (lambda t: (mod.tap_take_calls(t), mod.tap_take_acts(t), mod.tap_take_grads(t)))
    for r in range(a.rounds):
        for k in list(configs) if r % 2 == 0 else list(configs)[::-1]:
            c = configs[k]
            if c is not None:
                mod.tap_start(c[0], r + 1, c[2])
                calls.listen_calls(listener, c[1])
            t = clock()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            f = clock() - t
            t = clock()
            loss.backward()
            b = clock() - t
            model.zero_grad(set_to_none=True)
            if c is not None:
                calls.unlisten_calls(listener)
                take(c[0])
                mod.tap_start(c[0], 0, False)
            if r >= 5:
                times[k][0].append(f)
                times[k][1].append(b)
    base = times.get("no watch")
    f0 = statistics.median(base[0]) if base else 0.0
    b0 = statistics.median(base[1]) if base else 0.0
    print(f"deep MLP (386 modules), {a.rounds} rounds, one thread; ms, medians (difference to no watch)")
    for k, (fs, bs) in times.items():
        f, b = statistics.median(fs), statistics.median(bs)
        print(f"  {k:9} forward {f * 1e3:7.3f} ({(f - f0) * 1e3:+.3f})   backward {b * 1e3:7.3f} ({(b - b0) * 1e3:+.3f})")


if __name__ == "__main__":
    main()
