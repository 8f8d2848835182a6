"""One table of what the Monitor costs a step on a GPU: bare vs full statistics vs sentinel, on the GPT-style
and the ResNet-style bench models, timed with CUDA events, with the host syncs of one Monitor step.

    python bench/gpu_table.py [--device cuda] [--rounds 5] [--steps 10] [--models gpt,resnet]
    python bench/gpu_table.py --dry      # the same code end to end on the CPU (perf_counter; syncs not counted)

Each variant has its own copy of the model (same initial weights), AdamW and GradScaler (init_scale 2^10), FP16
autocast; variants interleaved (A B C, C B A, ...), a warm-up step each first. A step's time is the CUDA events'
elapsed time between the step's start and end (one synchronize after the step, outside the timed span). ``ratio``
is the median over rounds of the variant's median step over bare's in the same round. ``syncs``: the host
synchronisations ``torch.cuda.set_sync_debug_mode("warn")`` reports in one Monitor step after the warm-up.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, loss_fn  # noqa: E402

from ampdoctor.engine.monitor import Monitor  # noqa: E402

VARIANTS = ("bare", "full", "sentinel")


class Variant:
    def __init__(self, name: str, model: nn.Module, device: torch.device) -> None:
        self.name, self.device = name, device
        self.model = copy.deepcopy(model).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
        self.monitor: Monitor | None = None
        if name == "full":
            self.monitor = Monitor(self.model, self.opt, self.scaler, every=1, keep_stats=False, alert_min_steps=10**9)
        elif name == "sentinel":
            self.monitor = Monitor(self.model, self.opt, self.scaler, mode="sentinel", full_every=1000, keep_stats=False,
                                   alert_min_steps=10**9)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.float16):
            loss = loss_fn(self.model(x), y)
        if self.monitor is not None:
            self.monitor.step(loss)
            return
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)

    def timed(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step's milliseconds: CUDA events on a GPU, perf_counter on the CPU."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.step(x, y)
            end.record()
            torch.cuda.synchronize(self.device)
            return float(start.elapsed_time(end))
        t0 = time.perf_counter()
        self.step(x, y)
        return (time.perf_counter() - t0) * 1e3

    def syncs(self, x: torch.Tensor, y: torch.Tensor) -> int | None:
        """Host syncs of one step (None on the CPU, where there are none to count)."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                self.step(x, y)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return sum(1 for m in w if "synchroniz" in str(m.message).lower())


def measure(model_name: str, device: torch.device, rounds: int, steps: int, dry: bool = False) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, batch = MODELS[model_name]()
    g = torch.Generator().manual_seed(0)
    x, y = batch(g)
    if dry:  # 2 samples, 8 positions or 8x8 pixels: FP16 on a CPU is emulated and slow; the logic is what is run
        x, y = (x[:2, :8], y[:2, :8]) if x.dim() == 2 else (x[:2, :, :8, :8], y[:2])
    x, y = x.to(device), y.to(device)
    vs = [Variant(n, model, device) for n in VARIANTS]
    syncs = {}
    for v in vs:
        v.step(x, y)  # warm-up (kernels, the Monitor's first step)
        syncs[v.name] = v.syncs(x, y)
    per_round: dict[str, list[float]] = {v.name: [] for v in vs}
    for r in range(rounds):
        for v in (vs if r % 2 == 0 else vs[::-1]):
            per_round[v.name].append(statistics.median(v.timed(x, y) for _ in range(steps)))
    for v in vs:
        if v.monitor is not None:
            v.monitor.close()
    bare = per_round["bare"]
    return [{"model": model_name, "variant": n, "ms": statistics.median(t),
             "ratio": statistics.median(a / b for a, b in zip(t, bare, strict=True)), "syncs": syncs[n]} for n, t in per_round.items()]


def table(rows: list[dict[str, Any]], device: str) -> str:
    out = [f"device: {device}", f"{'model':<8} {'variant':<9} {'ms/step':>9} {'x bare':>7} {'syncs':>6}"]
    for r in rows:
        s = "-" if r["syncs"] is None else str(r["syncs"])
        out.append(f"{r['model']:<8} {r['variant']:<9} {r['ms']:>9.2f} {r['ratio']:>7.3f} {s:>6}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default="gpt,resnet")
    ap.add_argument("--dry", action="store_true", help="on the CPU, 2 rounds of 1 step on tiny batches: the logic end to end")
    a = ap.parse_args(argv)
    if a.dry:
        a.device, a.rounds, a.steps = "cpu", 2, 1
    device = torch.device(a.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run: no GPU timings)"
    rows = [r for m in a.models.split(",") for r in measure(m.strip(), device, a.rounds, a.steps, a.dry)]
    text = table(rows, name)
    print(text)
    return text


if __name__ == "__main__":
    main()
