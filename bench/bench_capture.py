"""What arming the capture costs a Monitor step, and what a capture costs when it is written.

    python bench/bench_capture.py [--device cpu|cuda] [--rounds 5] [--steps 200] [--models deep_mlp,gpt]

One process; two variants per model, interleaved step by step (A B A B ...), each with its own copy
of the model (same initial weights), AdamW and GradScaler, autocast fp16, and a Monitor with the same
settings: ``monitor`` (no capture) and ``armed`` (``capture=...``, ``snapshot_every=100``, the batch
passed to every step). The median step time of each and the ratio armed / monitor are printed; the
snapshot steps are inside the medians' population (one step in ``snapshot_every``).

Before that, the armed path's own work is timed alone (``direct``): what arming adds to a step
when nothing fails, without the noise of two whole training steps. Then, for each model, one capture is written (an Inf injected into a gradient at the last step after
calibration) and its write time and size on disk are printed.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, loss_fn  # noqa: E402

from ampdoctor import Monitor  # noqa: E402
from ampdoctor.capture.write import Capture  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, device: torch.device, rounds: int, steps: int, every: int) -> None:
    model, make_batch = MODELS[name]()
    g = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(device) for t in make_batch(g)) for _ in range(16)]
    tmp = Path(tempfile.mkdtemp(prefix="ampdoctor-bench-"))
    variants = {}
    for v in ("monitor", "armed"):
        m = copy.deepcopy(model).to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
        cap = tmp / v if v == "armed" else None
        mon = Monitor(m, opt, scaler, capture=cap, snapshot_every=100, every=every)
        variants[v] = (m, mon, [])
    for _ in range(rounds):
        for i in range(steps):
            x, y = batches[i % len(batches)]
            for _v, (m, mon, times) in variants.items():
                _sync(device)
                t0 = time.perf_counter()
                with mon.autocast():
                    loss = loss_fn(m(x), y)
                mon.step(loss, batch=(x, y))
                _sync(device)
                times.append(time.perf_counter() - t0)
    med = {v: statistics.median(t) for v, (_, _, t) in variants.items()}
    print(f"{name:9s} every={every:<3d} monitor {med['monitor'] * 1e3:7.2f} ms  armed {med['armed'] * 1e3:7.2f} ms  "
          f"ratio {med['armed'] / med['monitor']:.3f}  ({rounds} x {steps} steps, snapshot_every=100)")
    # one capture, written for real: an Inf in a gradient at a scale that already carried a step
    m, mon, _ = variants["armed"]
    mon.inject_inf_at = {mon.step_num}
    x, y = batches[0]
    with mon.autocast():
        loss = loss_fn(m(x), y)
    t0 = time.perf_counter()
    rec = mon.step(loss, batch=(x, y))
    took = time.perf_counter() - t0
    folder = Path(rec.capture) if rec.capture else None
    size = sum(f.stat().st_size for f in folder.iterdir()) if folder else 0
    params = sum(p.numel() for p in m.parameters())
    print(f"{name:9s} capture of step {rec.step}: {'written' if folder else 'NOT written'} in {took * 1e3:.0f} ms "
          f"(the whole step), {size / 1e6:.1f} MB on disk, {params / 1e6:.2f} M parameters")
    for _v, (_m, mn, _t) in variants.items():
        mn.close()


def direct(name: str, steps: int = 400) -> None:
    """The armed path's own work, timed alone: the per-step bookkeeping (the batch's host copy, the
    failing-step test) and the snapshot step (model and optimizer state copied every 100 steps)."""
    model, make_batch = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = make_batch(torch.Generator().manual_seed(0))
    loss_fn(model(x), y).backward()
    opt.step()  # Adam has its state: the snapshot copies it
    cap = Capture(Path(tempfile.mkdtemp()) / "unused", model, opt, None, 100)
    plain, snap = [], []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        cap.before_update(step, (x, y))
        cap.judge(skipped=False, reason="", scale=1024.0, alert=False)
        (snap if step % 100 == 0 else plain).append(time.perf_counter() - t0)
    p, s = statistics.median(plain), statistics.median(snap)
    print(f"{name:9s} armed bookkeeping: {p * 1e6:.0f} us a step, snapshot step {s * 1e3:.1f} ms; "
          f"{(p * 99 + s) / 100 * 1e3:.3f} ms a step amortised over snapshot_every=100")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=1, help="Monitor(every=...) in both variants")
    ap.add_argument("--models", default="deep_mlp,gpt")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    for name in a.models.split(","):
        direct(name.strip())
        measure(name.strip(), torch.device(a.device), a.rounds, a.steps, a.every)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
