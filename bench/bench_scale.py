"""What the capture and the per-step statistics cost as the model grows: the numbers docs/scale-out.md fits.

    python bench/bench_scale.py [--sizes 1,4,16] [--modules 16,64,256] [--steps 6]

1. The capture's snapshot (``Capture.state``: host copies of the weights, AdamW's two moments, the scaler) of an MLP
   of N million FP32 parameters: its bytes (``capture.state.nbytes``) and the process CPU seconds of one copy
   (median of 3).
2. The Monitor's full statistics: process CPU seconds of one FP32 AdamW step of a deep MLP of M blocks
   (Linear(64,64) -> LayerNorm -> GELU, batch 32), bare and under ``Monitor(every=1)``, median over rounds,
   the difference per module. Process CPU time (one thread), so other processes on the machine count less.
Prints one CSV-like table per part; docs/scale-out.md fits them (least squares, with the largest residual).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from ampdoctor.capture.state import nbytes
from ampdoctor.capture.write import Capture
from ampdoctor.engine.monitor import Monitor


def mlp(n_million: float) -> nn.Module:
    width = 1024
    layers = max(1, round(n_million * 1e6 / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def snapshot_row(n_million: float) -> tuple[int, int, float]:
    model = mlp(n_million)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()  # the moments exist
    cap = Capture(path=__import__("pathlib").Path("/nonexistent"), model=model, optimizer=opt,
                  scaler=torch.amp.GradScaler("cpu"))
    times = []
    for _ in range(3):
        t0 = time.process_time()
        st = cap.state()
        times.append(time.process_time() - t0)
    return sum(p.numel() for p in model.parameters()), nbytes(st), statistics.median(times)


def deep(blocks: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 1))


def step_row(blocks: int, steps: int) -> tuple[int, float, float]:
    torch.manual_seed(0)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    rows = []
    for watched in (False, True):
        model = deep(blocks)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mon = Monitor(model, opt, every=1, keep_stats=False, alert_min_steps=10**9) if watched else None
        ts = []
        for i in range(steps + 1):
            t0 = time.process_time()
            loss = nn.functional.mse_loss(model(x), y)
            if mon is not None:
                mon.step(loss)
            else:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if i:  # the first step warms up
                ts.append(time.process_time() - t0)
        if mon is not None:
            mon.close()
        rows.append(statistics.median(ts))
    modules = sum(1 for _ in deep(blocks).modules()) - 1
    return modules, rows[0], rows[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16", help="snapshot sizes, millions of parameters")
    ap.add_argument("--modules", default="16,64,256", help="deep-MLP blocks (3 modules each)")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("params,snapshot_bytes,copy_cpu_s")
    for n in a.sizes.split(","):
        p, b, t = snapshot_row(float(n))
        print(f"{p},{b},{t:.4f}", flush=True)
    print("modules,bare_cpu_s,full_cpu_s,extra_per_module_us")
    for m in a.modules.split(","):
        mods, bare, full = step_row(int(m), a.steps)
        print(f"{mods},{bare:.5f},{full:.5f},{(full - bare) / mods * 1e6:.2f}", flush=True)


if __name__ == "__main__":
    main()
