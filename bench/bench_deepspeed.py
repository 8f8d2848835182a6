"""What ``ampdoctor.integrations.deepspeed.watch`` costs per DeepSpeed step, on the CPU (2 gloo processes).

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_deepspeed.py \
        [--stage 2] [--width 256] [--blocks 4] [--rounds 6] [--steps 20] [--mode full]

An MLP of ``--blocks`` Linear(width, width) + GELU blocks between an ``embed`` and a ``head``, ZeRO
``--stage``, fp16 (the CPU accelerator's fp16 check overridden, as the tests do), AdamW, batch 16. One
engine trains throughout; rounds alternate bare and watched phases (``watch(engine, log=..., mode=...)``
then ``close()``, which restores the engine's methods), ``--steps`` steps each, the first 2 steps of every
phase not counted. A step's time is ``engine(x)`` + loss + ``engine.backward`` + ``engine.step`` on rank 0.
Reported: the median step time of each, and their ratio."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mode", default="full", choices=["full", "sentinel"])
    a = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ampdoctor.integrations.deepspeed import watch

    type(get_accelerator()).is_fp16_supported = lambda self: True  # type: ignore[method-assign]
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, a.width)]
    for _ in range(a.blocks):
        layers += [nn.GELU(), nn.Linear(a.width, a.width)]
    layers += [nn.GELU(), nn.Linear(a.width, 8)]
    model = nn.Sequential(*layers)
    cfg = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10**6, "zero_optimization": {"stage": a.stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "fp16": {"enabled": True, "initial_scale_power": 12}, "gradient_clipping": 1.0}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = engine.global_rank
    times: dict[str, list[float]] = {"bare": [], "watched": []}
    phases: list[str] = []
    tmp = Path(tempfile.mkdtemp())
    g = torch.Generator().manual_seed(rank)
    for r in range(a.rounds):
        for kind in (("bare", "watched") if r % 2 == 0 else ("watched", "bare")):
            mon = watch(engine, log=tmp / f"steps{r}.csv", mode=a.mode, quiet=True) if kind == "watched" else None
            for s in range(a.steps + 2):
                x = torch.randn(16, 32, generator=g).half()
                y = torch.randn(16, 8, generator=g)
                t = time.perf_counter()
                loss = ((engine(x).float() - y) ** 2).mean()
                engine.backward(loss)
                engine.step()
                if s >= 2:
                    times[kind].append(time.perf_counter() - t)
            if mon is not None:
                mon.close()
            phases.append(f"{kind[0]}{statistics.median(times[kind][-a.steps:]) * 1e3:.0f}")
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        b, w = statistics.median(times["bare"]), statistics.median(times["watched"])
        print(f"ZeRO-{a.stage} fp16, {n:,} parameters, mode={a.mode}, {len(times['bare'])} steps each: "
              f"bare {b * 1e3:.2f} ms/step, watched {w * 1e3:.2f} ms/step, {w / b:.2f}x; phases (ms): {' '.join(phases)}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
