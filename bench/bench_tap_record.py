"""What the C++ recorder costs one recorded module call, by what it does: a chain of 386 calls of a
Linear(64, 64) on a 32x64 batch under FP16 autocast (the deep MLP's call count and activation size), handed to
the tap as the ``__call__`` wrapper hands them (``fused.tap_caller``). Configurations: nothing but the call and
its tensor ids, the training check on (the Monitor's: grad mode and the model's ``training``), the activations'
rows, the gradient taps, all of them. The chain is rebuilt outside the timing for every round (its gradient
taps are fresh, its tensors new to the tap and out of cache, as in a forward); with ``--hot`` it is built once
(the tap's own cost with its data in cache; the gradient taps left out, which would pile up on the same
tensors). The best round over ``--seconds``, nanoseconds a call.

    python bench/bench_tap_record.py [--seconds 3] [--hot]
"""

from __future__ import annotations

import argparse
import time
import weakref

import torch
from torch import nn

from ampdoctor.watch import fused
from ampdoctor.watch import stats as watch_stats

CALLS = 386


def per_call(mod: object, acts: bool, grads: bool, training_only: bool, seconds: float, hot: bool) -> tuple[float, int]:
    lin = nn.Linear(64, 64)
    root = nn.Sequential(lin)
    tap = mod.Tap(1 << 22, acts, grads, True, *watch_stats._thresholds(watch_stats.FP16), lambda: None)  # type: ignore[attr-defined]
    mod.tap_configure(tap, [root, lin], weakref.ref(root), training_only)  # type: ignore[attr-defined]
    fast = mod.tap_caller(tap)  # type: ignore[attr-defined]
    x = torch.randn(32, 64, requires_grad=True)
    kw: dict = {}
    best, rounds, end, serial = float("inf"), 0, time.monotonic() + seconds, 0
    calls: list[tuple[tuple[torch.Tensor], torch.Tensor]] = []
    while time.monotonic() < end:
        if not (hot and calls):
            chain = [x]
            with torch.autocast("cpu", dtype=torch.float16):
                for _ in range(CALLS):
                    chain.append(lin(chain[-1]))
            calls = [((chain[i],), chain[i + 1]) for i in range(CALLS)]
        serial += 1
        mod.tap_start(tap, serial, True)  # type: ignore[attr-defined]
        t = time.perf_counter()
        for a, out in calls:
            fast(lin, a, kw, out)
        best = min(best, time.perf_counter() - t)
        rounds += 1
        mod.tap_take_calls(tap), mod.tap_take_acts(tap), mod.tap_take_grads(tap)  # type: ignore[attr-defined]
    return best / CALLS * 1e9, rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--hot", action="store_true", help="the same chain every round (no gradient taps)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    mod = fused.build_now()
    if mod is None:
        raise SystemExit("the C++ kernel cannot be built here (no compiler or ninja)")
    print(f"torch {torch.__version__}, one thread; {CALLS} recorded calls a round ({'the same' if a.hot else 'new'} "
          "tensors each round), best round, ns a call")
    for label, acts, grads, train in [("ids only", False, False, False), ("+ training check", False, False, True),
                                      ("+ activation rows", True, False, True), ("+ gradient taps", False, True, True),
                                      ("all (the Monitor's)", True, True, True)]:
        if a.hot and grads:
            continue
        ns, rounds = per_call(mod, acts, grads, train, a.seconds, a.hot)
        print(f"  {label:22s} {ns:6.0f} ns  ({rounds} rounds)")


if __name__ == "__main__":
    main()
