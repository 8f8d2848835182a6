"""Time that `ampdoctor layers` adds over the bare FP32 reference steps it runs.

Both sides run the same steps (forward, loss, backward, optimizer step) on the same batches from
the same weights; `layers` adds the hooks, the on-device statistics for every format and the one
host copy per step. Repeats are interleaved (bare, layers, bare, layers, ...) so drift in the
machine's load hits both alike; the medians are reported.

    python bench/bench_layers.py                                  # sample_models/forward_overflow.py, fp16
    python bench/bench_layers.py --dtype fp16,bf16,fp8_e4m3 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ampdoctor.engine.forward import default_optimizer, get_loss
from ampdoctor.engine.layers import layer_stats
from ampdoctor.engine.triage import prepare
from ampdoctor.input.batches import split, to_device
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "sample_models" / "forward_overflow.py"))
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--scale", default="1")
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args()

    device = torch.device("cpu")
    spec = load_spec(args.spec)
    model, batches = prepare(spec, TriageConfig(steps=args.steps, device="cpu"), device)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    scale: float | str = "auto" if args.scale == "auto" else float(args.scale)

    def bare() -> float:
        model.load_state_dict(init)
        torch.manual_seed(0)
        opt = default_optimizer(model.parameters())
        t0 = time.perf_counter()
        for step in range(args.steps):
            a, kw, target = split(to_device(batches[step], device))
            opt.zero_grad(set_to_none=True)
            get_loss(model(*a, **kw), target, spec.loss_fn).backward()
            opt.step()
        return time.perf_counter() - t0

    def layers() -> float:
        model.load_state_dict(init)
        t0 = time.perf_counter()
        layer_stats(model, batches, args.dtype, steps=args.steps, scale=scale, loss_fn=spec.loss_fn, device=device)
        return time.perf_counter() - t0

    bare()
    layers()  # warm-up: first calls pay for lazy initialisation
    b, ls = [], []
    for _ in range(args.repeats):
        b.append(bare())
        ls.append(layers())
    mb, ml = statistics.median(b), statistics.median(ls)
    print(f"spec {Path(args.spec).name}, --dtype {args.dtype}, --steps {args.steps}, --scale {args.scale}, "
          f"{args.repeats} interleaved repeats, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"bare FP32 steps: median {1000 * mb:.1f} ms")
    print(f"layer_stats:     median {1000 * ml:.1f} ms")
    print(f"added by layers: {1000 * (ml - mb):.1f} ms ({1000 * (ml - mb) / args.steps:.1f} ms per step, {ml / mb:.1f}x)")


if __name__ == "__main__":
    main()
