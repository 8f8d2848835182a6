"""Per-step overhead of full per-layer monitoring against the tools users reach for today.

    python bench/bench_overhead.py [--device cpu|cuda] [--rounds 7] [--steps 5] [--models deep_mlp,gpt,wide,word_lm]
        [--variants bare,ampdoctor full,ampdoctor sentinel] [--threads N]

One process, variants interleaved (A B C C B A A B C ...), each variant with its own copy of the model
(same initial weights), its own optimizer (AdamW) and GradScaler; autocast fp16 + GradScaler in
every variant. Reports the median step time of each variant and three ratios to the bare step:
``ratio`` (of the medians), ``paired`` (the median over rounds of the ratio within each round: the
steadiest on a machine whose speed drifts), ``mean`` (of the means: rare slow steps included) and ``low`` (of the
10th percentiles: the least disturbed steps, the steadiest where other machines' work slows random steps).

Variants: bare | detect_anomaly (check_nan=True) | DebugUnderflowOverflow (if transformers is
installed) | ampdoctor Monitor with full statistics every step | Monitor every 10th step |
Monitor(mode="sentinel", full_every=1000), the always-on mode | "ampdoctor full no ring": full statistics
with the lookback ring off (``ring=0``; every other Monitor variant keeps its default ring of 256 steps) |
Monitor with no statistics at all
(``every=10**9``, variant "ampdoctor monitor only": loss check, norms, skip decision, log row).
Then, per model: the statistics of one step against one plain pass over the same tensors
(torch._foreach_norm), and, with --device cuda, the host syncs of a Monitor step counted with
torch.cuda.set_sync_debug_mode.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, loss_fn  # noqa: E402

from ampdoctor.engine.monitor import Monitor  # noqa: E402
from ampdoctor.formats import FP16  # noqa: E402
from ampdoctor.watch.stats import StatsBuffer  # noqa: E402

INIT_SCALE = 2.0**10  # low enough that no variant starts with overflow skips (detect_anomaly raises on them)

CLOCK = time.perf_counter
"""What a step is timed with (--clock)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Variant:
    def __init__(self, name: str, model: nn.Module, device: torch.device) -> None:
        self.name = name
        self.model = copy.deepcopy(model).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE)
        self.device = device
        self.times: list[float] = []
        self.ctx: Callable[[], Any] = contextlib.nullcontext
        self.monitor: Monitor | None = None
        self.duo: Any = None
        if name == "detect_anomaly":
            self.ctx = lambda: torch.autograd.detect_anomaly(check_nan=True)
        elif name == "DebugUnderflowOverflow":
            from transformers.debug_utils import DebugUnderflowOverflow

            self.duo = DebugUnderflowOverflow(self.model)
        elif name == "ampdoctor monitor only":  # the monitor's own per-step work: no statistics, no sentinel
            self.monitor = Monitor(self.model, self.opt, self.scaler, every=10**9, keep_stats=False, alert_min_steps=10**9)
        elif name == "ampdoctor sentinel":
            self.monitor = Monitor(self.model, self.opt, self.scaler, mode="sentinel", full_every=1000, keep_stats=False,
                                   alert_min_steps=10**9)
        elif name == "ampdoctor full no ring":  # full statistics without the lookback ring (engine.ring)
            self.monitor = Monitor(self.model, self.opt, self.scaler, every=1, keep_stats=False, alert_min_steps=10**9, ring=0)
        elif name == "ampdoctor full no forecast":  # full statistics, the ring, no forecast (nor its op watch: engine.growth)
            self.monitor = Monitor(self.model, self.opt, self.scaler, every=1, keep_stats=False, alert_min_steps=10**9,
                                   forecast_horizon=None)
        elif name.startswith("ampdoctor"):
            every = 10 if name.endswith("every 10") else 1
            self.monitor = Monitor(self.model, self.opt, self.scaler, every=every, keep_stats=False, alert_min_steps=10**9)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        t0 = CLOCK()
        with self.ctx():
            with torch.autocast(self.device.type, dtype=torch.float16):
                loss = loss_fn(self.model(x), y)
            if self.monitor is not None:
                self.monitor.step(loss)
            else:
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.opt)
                self.scaler.step(self.opt)
                self.scaler.update()
                self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        self.times.append(CLOCK() - t0)


def step_tensors(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Every tensor the monitor reads in one step: module outputs, gradients at them, param grads, params."""
    outs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []

    def fwd(_m: nn.Module, _i: Any, o: Any) -> None:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            outs.append(o)
            if o.requires_grad:
                o.register_hook(lambda g: grads.append(g))

    hs = [m.register_forward_hook(fwd) for m in model.modules()]
    with torch.autocast(device.type, dtype=torch.float16):
        loss = loss_fn(model(x), y)
    (loss * INIT_SCALE).backward()
    for h in hs:
        h.remove()
    ps = list(model.parameters())
    # what the Monitor watches by default: module outputs, gradients at them, parameter gradients
    return [o.detach() for o in outs] + grads + [p.grad for p in ps if p.grad is not None]


def monitor_stats(ts: list[torch.Tensor]) -> Any:
    """The statistics exactly as the monitor computes them: StatsBuffer batches, then one collect."""
    buf = StatsBuffer(FP16)
    for i, t in enumerate(ts):
        buf.add(i, t)
    return buf.collect()


def time_it(fn: Callable[[], Any], device: torch.device, repeats: int = 15) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        sync(device)
        t0 = CLOCK()
        fn()
        sync(device)
        ts.append(CLOCK() - t0)
    return statistics.median(ts)


def paired(times: list[float], bare: list[float], steps: int) -> float:
    """The median over rounds of (this variant's median step in the round / the bare step's in the same round):
    each ratio compares steps taken seconds apart, so a machine that speeds up or slows down between rounds
    moves both. ``ratio`` compares the medians of the whole run; ``mean`` the means (what a run of many steps
    pays, rare slow steps such as a garbage collection included)."""
    rounds = len(bare) // steps
    return statistics.median(statistics.median(times[r * steps:(r + 1) * steps]) /
                             statistics.median(bare[r * steps:(r + 1) * steps]) for r in range(rounds))


def low(times: list[float]) -> float:
    """The 10th percentile of the step times (``low``): a step slowed by another process's work on the machine lies
    above it, so its ratio to the bare step's is the steadiest where that noise comes and goes quickly."""
    return statistics.quantiles(times, n=10)[0] if len(times) >= 10 else min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--models", default="deep_mlp,gpt,wide,word_lm")
    ap.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (time.process_time), steadier on a shared machine")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--stats-only", action="store_true", help="only the statistics-against-one-pass measurement")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    device = torch.device(a.device)
    names = ["bare", "detect_anomaly"]
    try:
        import transformers  # noqa: F401

        names.append("DebugUnderflowOverflow")
    except ImportError:
        print("transformers not installed: DebugUnderflowOverflow skipped (pip install 'ampdoctor[transformers]')")
    names += ["ampdoctor full", "ampdoctor full no ring", "ampdoctor every 10", "ampdoctor sentinel"]
    if a.variants:
        names = a.variants.split(",")
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, clock {a.clock}, load average {os.getloadavg()[0]:.1f}, device {device}, {torch.get_num_threads()} threads; "
          f"{a.rounds} rounds x {a.steps} steps per variant, interleaved; medians")
    for mname in a.models.split(","):
        torch.manual_seed(0)
        model, make_batch = MODELS[mname]()
        g = torch.Generator().manual_seed(0)
        batches = [tuple(t.to(device) for t in make_batch(g)) for _ in range(4)]
        variants = [Variant(n, model, device) for n in (names if not a.stats_only else [])]
        for v in variants:  # warm-up
            for x, y in batches[:2]:
                v.step(x, y)
            v.times.clear()
        i = 0
        for r in range(a.rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):  # alternate the order: drift cancels
                for _ in range(a.steps):
                    x, y = batches[i % len(batches)]
                    i += 1
                    v.step(x, y)
        nparams = sum(p.numel() for p in model.parameters())
        print(f"\n{mname} ({sum(1 for _ in model.modules())} modules, {nparams:,} parameters)")
        if variants:
            base = statistics.median(variants[0].times)
            bare_mean = statistics.fmean(variants[0].times)
            base_low = low(variants[0].times)
            print(f"  {'variant':24} {'median ms':>10} {'ratio':>7} {'paired':>7} {'mean':>7} {'low':>7}")
        for v in variants:
            m = statistics.median(v.times)  # noqa: F821 - base is set when there are variants
            print(f"  {v.name:24} {m * 1e3:10.2f} {m / base:7.2f} {paired(v.times, variants[0].times, a.steps):7.3f} "
                  f"{statistics.fmean(v.times) / bare_mean:7.3f} {low(v.times) / base_low:7.3f}")
            if v.monitor is not None:
                v.monitor.close()
        # statistics against one plain pass over the same tensors
        x, y = batches[0]
        ts = step_tensors(copy.deepcopy(model).to(device), x, y, device)
        numel = sum(t.numel() for t in ts)
        t_stats = time_it(lambda ts=ts: monitor_stats(ts), device)
        t_norm = time_it(lambda ts=ts: torch._foreach_norm(ts), device)
        print(f"  statistics of one step: {len(ts)} tensors, {numel:,} elements: ampdoctor {t_stats * 1e3:.2f} ms, "
              f"_foreach_norm {t_norm * 1e3:.2f} ms, ratio {t_stats / t_norm:.2f}")
        if device.type == "cuda":
            v = Variant("ampdoctor full", model, device)
            x, y = batches[0]
            v.step(x, y)
            torch.cuda.set_sync_debug_mode("warn")
            import warnings

            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                v.step(x, y)
            torch.cuda.set_sync_debug_mode(0)
            print(f"  host syncs in one Monitor step (GradScaler's own included): {len(w)}")


if __name__ == "__main__":
    main()
