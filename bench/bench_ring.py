"""The lookback ring's host memory, and its own per-step work, for each bench model.

    python bench/bench_ring.py [--models gpt,deep_mlp] [--ring 256] [--steps 40]

Per model: the layers the ring keeps, its fixed buffers in bytes for ``--ring`` steps (``Ring.memory_bytes``:
the step numbers, the per-step scalars and the layers x figures, allocated once), and the CPU time
(``time.process_time``) of the ring's push plus forecast per recorded step, taken apart from the step
itself (the step's overhead with the ring on and off: ``bench_overhead.py --variants "bare,ampdoctor
full,ampdoctor full no ring"``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, loss_fn  # noqa: E402

from ampdoctor.engine.monitor import Monitor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,deep_mlp")
    ap.add_argument("--ring", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name in a.models.split(","):
        model, batch = MODELS[name]()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        mon = Monitor(model, opt, scaler, ring=a.ring, keep_stats=False, alert_min_steps=10**9, quiet=True)
        lb = mon.lookback
        assert lb is not None
        push = lb.push
        spent: list[float] = []

        def timed(*args: object, _push=push, _spent=spent, **kw: object) -> object:  # noqa: ANN001
            t0 = time.process_time()
            out = _push(*args, **kw)  # type: ignore[arg-type]
            _spent.append(time.process_time() - t0)
            return out

        lb.push = timed  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(0)
        for _ in range(a.steps):
            x, y = batch(g)
            with mon.autocast():
                loss = loss_fn(model(x), y)
            mon.step(loss)
        mon.close()
        ring = lb.ring
        print(f"{name}: {len(ring.names)} layers, ring of {ring.capacity} steps: {ring.memory_bytes:,} bytes "
              f"({ring.memory_bytes / 2**20:.2f} MiB); push + forecast per step: median "
              f"{1e3 * statistics.median(spent[5:]):.3f} ms CPU over {len(spent) - 5} steps")


if __name__ == "__main__":
    main()
