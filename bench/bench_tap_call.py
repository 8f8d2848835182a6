"""One module call's cost in the C++ recorder's hook: the pybind function through ``functools.partial`` (the old
binding) against the C function bound to the tap (``fused.tap_caller``), with the tap inactive (a step not recorded)
and active (recording, activations off); the best of five repeats, nanoseconds a call.

    python bench/bench_tap_call.py
"""

from __future__ import annotations

import functools
import timeit

import torch

from ampdoctor.watch import fused


def main() -> None:
    mod = fused.build_now()
    if mod is None:
        raise SystemExit("the C++ kernel cannot be built here (no compiler or ninja)")
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    out = lin(x)
    tap = mod.Tap(1 << 22, False, False, True, 1, 2, 3, lambda: None)
    mod.tap_configure(tap, [lin], None, False)
    ways = [("pybind + partial", functools.partial(mod.tap_call, tap)), ("tap_caller", mod.tap_caller(tap))]
    args: tuple = (x,)
    kw: dict = {}
    n = 200_000
    mod.tap_start(tap, 1, False)
    for name, f in ways:
        t = min(timeit.repeat(lambda f=f: f(lin, args, kw, out), number=n, repeat=5)) / n
        print(f"{name:18s} inactive {t * 1e9:6.0f} ns a call")
    for name, f in ways:
        def burst(f=f) -> None:  # (a new step every 100 calls: the recorder's vectors stay small)
            mod.tap_start(tap, 1, True)
            for _ in range(100):
                f(lin, args, kw, out)
        t = min(timeit.repeat(burst, number=2000, repeat=5)) / (2000 * 100)
        print(f"{name:18s} active   {t * 1e9:6.0f} ns a call")


if __name__ == "__main__":
    main()
