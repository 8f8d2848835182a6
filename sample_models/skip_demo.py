"""Demo of ampdoctor.Monitor: a small model trained 20 steps with an Inf injected into a gradient at step 5.

    python sample_models/skip_demo.py                 # FP16 autocast + GradScaler: SKIP at step 5, scale halves
    python sample_models/skip_demo.py --bf16          # bf16 autocast, no scaler, no injection: nothing skipped
    python sample_models/skip_demo.py --spike-at 8    # targets x1e8 at step 8: a real overflow, not a synthetic Inf
    python sample_models/skip_demo.py --log steps.csv # the per-step CSV (then: ampdoctor scaler steps.csv)

Prints one STEP or SKIP line a step. Not a triage spec (it defines no build_model); importing it
runs nothing.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from ampdoctor import Monitor
from ampdoctor.engine.monitor import MonitorRecord


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))


def make_batches(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 16, generator=g)
        out.append((x.to(device), (x @ w + 0.1 * torch.randn(32, 1, generator=g)).to(device)))
    return out


def line(r: MonitorRecord) -> str:
    kind = "SKIP" if r.skipped else "STEP"
    scale = "" if r.scaler_scale is None else f"  scale {r.scaler_scale:g} -> {r.scale_after:g}"
    text = f"{kind} {r.step:3d}  loss {r.loss:.4f}  grad_l2 {r.grad_l2_pre_clip:.4g} -> {r.grad_l2_post_clip:.4g}{scale}"
    if r.skipped:
        text += f"  reason {r.skip_reason}"
        if r.nonfinite_params:
            text += f" ({', '.join(r.nonfinite_params)})"
    if r.injected:
        text += f"  [injected {r.injected}]"
    return text


def run(
    steps: int = 20,
    bf16: bool = False,
    inject_at: int | None = 5,
    spike_at: int | None = None,
    log: str | None = None,
    device: str = "auto",
    seed: int = 0,
) -> list[MonitorRecord]:
    """Train and return the records (the demo's core; ``main`` prints them)."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    torch.manual_seed(seed)
    model = make_model().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # bf16 has FP32's exponent range: no loss scaling. FP16: a scaler that starts low enough not to
    # overflow this model, and grows after 10 clean steps so the demo shows a growth as well.
    scaler = None if bf16 else torch.amp.GradScaler(dev.type, init_scale=2.0**12, growth_interval=10)
    records = []
    with Monitor(model, opt, scaler, log=log, max_norm=1.0, amp_dtype=torch.bfloat16 if bf16 else torch.float16,
                 inject_inf_at=inject_at, inject_spike_at=spike_at) as mon:
        for x, y in make_batches(steps, dev):
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x), mon.spike(y))
            records.append(mon.step(loss))
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast without a scaler (no injection unless --inject-at)")
    ap.add_argument("--inject-at", type=int, default=None, help="step to inject an Inf into a gradient (default 5; -1: none)")
    ap.add_argument("--spike-at", type=int, default=None, help="step whose targets are multiplied by 1e8")
    ap.add_argument("--log", default=None, help="write the per-step CSV here (appends when resuming, refuses an old log)")
    ap.add_argument("--device", default="auto")
    a = ap.parse_args(argv)
    inject = a.inject_at if a.inject_at is not None else (None if a.bf16 else 5)
    if inject is not None and inject < 0:
        inject = None
    records = run(a.steps, a.bf16, inject, a.spike_at, a.log, a.device)
    for r in records:
        print(line(r))
    skipped = [r for r in records if r.skipped]
    print(f"{len(records)} steps, {len(skipped)} skipped" + (": " + ", ".join(f"{r.step} ({r.skip_reason})" for r in skipped)
                                                           if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
