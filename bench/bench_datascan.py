"""Wall time of the data scan that triage runs on every batch (ampdoctor.datascan.scan_batches).

    python bench/bench_datascan.py [--batches 20] [--shape 32,3,224,224] [--repeats 3]

Random normal images (nothing to report: every field is cleared in one pass) and the same batches
with one outlier and one NaN per batch (the full scan). Medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ampdoctor.input.batches import Batches
from ampdoctor.judge.datascan import scan_batches


def _time(b: Batches, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scan_batches(b)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--shape", default="32,3,224,224")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    shape = tuple(int(s) for s in a.shape.split(","))
    g = torch.Generator().manual_seed(0)
    items = [(torch.randn(*shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)) for _ in range(a.batches)]
    quiet = _time(Batches(items, cycled=False), a.repeats)
    for x, _ in items:
        x.view(-1)[0] = 1e6
        x.view(-1)[1] = float("nan")
    full = _time(Batches(items, cycled=False), a.repeats)
    print(f"{a.batches} batches of {'x'.join(map(str, shape))}: clean {quiet:.2f}s, with issues {full:.2f}s "
          f"(median of {a.repeats})")


if __name__ == "__main__":
    main()
