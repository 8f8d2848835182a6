"""What the Monitor costs under FSDP2: full statistics and sentinel mode against a bare FSDP2 step.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_fsdp2.py [--rounds 5] [--steps 8]
        [--warmup 2] [--blocks 16] [--width 64] [--json OUT.json]

Each rank (gloo, on the CPU, one torch thread) holds three copies of one model, a stack of ``--blocks`` x
(Linear(width, width) -> LayerNorm -> GELU) and a Linear head, each Linear ``fully_shard``-ed and the root too,
``MixedPrecisionPolicy(param_dtype=float16)``, AdamW and a ``ShardedGradScaler``: **bare** (PyTorch's recipe:
scaled backward, ``unscale_``, ``clip_grad_norm_``, step, update), **full** (the same loop with
``Monitor(...)`` watching through ``after_backward``/``after_step``, full statistics every step; the monitor
takes the global norm itself, so the loop's own clip stays) and **sentinel** (``mode="sentinel"``,
``full_every=100``). Every round runs each variant for ``--steps`` steps (the monitors of the other variants
paused), the order rotated from round to round; the first ``--warmup`` steps of each block are not counted.
Per step: process CPU time and wall clock. Rank 0 prints the medians and the ratios to bare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ampdoctor import Monitor


def build(blocks: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


class Variant:
    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.model = build(args.blocks, args.width)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
        self.mon = None if name == "bare" else Monitor(
            self.model, self.opt, self.scaler, mode="sentinel" if name == "sentinel" else "full", full_every=100,
            alert_min_steps=10**9, quiet=True)
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.gen = torch.Generator().manual_seed(dist.get_rank())
        self.width = args.width

    def step(self) -> tuple[float, float]:
        x = torch.randn(32, self.width, generator=self.gen)
        y = torch.randn(32, 1, generator=self.gen)
        c0, w0 = time.process_time(), time.perf_counter()
        loss = nn.functional.mse_loss(self.model(x).float(), y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), 1.0)
        if self.mon is not None:
            self.mon.after_backward(loss)
        self.scaler.step(self.opt)
        self.scaler.update()
        if self.mon is not None:
            self.mon.after_step()
        self.opt.zero_grad(set_to_none=True)
        return time.process_time() - c0, time.perf_counter() - w0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    variants = [Variant(n, args) for n in ("bare", "full", "sentinel")]
    for r in range(args.rounds):
        order = variants[r % 3:] + variants[: r % 3]
        for v in order:
            with contextlib.ExitStack() as stack:
                for o in variants:
                    if o is not v and o.mon is not None:
                        stack.enter_context(o.mon.paused())
                for s in range(args.steps):
                    c, w = v.step()
                    if s >= args.warmup:
                        v.cpu.append(c)
                        v.wall.append(w)
    for v in variants:
        if v.mon is not None:
            assert v.mon.off is None, v.mon.off
            v.mon.close()
    res: dict[str, Any] = {v.name: {"cpu_ms": statistics.median(v.cpu) * 1e3, "wall_ms": statistics.median(v.wall) * 1e3}
                           for v in variants}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if rank == 0:
        params = sum(math.prod(p.shape) for p in variants[0].model.parameters())
        print(f"FSDP2, 2 ranks (gloo, CPU, 1 thread), {args.blocks} blocks of width {args.width} ({params:,} parameters), "
              f"fp16 params + ShardedGradScaler; {args.rounds} rounds x {args.steps - args.warmup} timed steps")
        print("rank | variant | CPU ms/step | x bare | wall ms/step | x bare")
        for k, rr in enumerate(gathered):
            for n in ("bare", "full", "sentinel"):
                print(f"{k} | {n} | {rr[n]['cpu_ms']:.2f} | {rr[n]['cpu_ms'] / rr['bare']['cpu_ms']:.3f} | "
                      f"{rr[n]['wall_ms']:.2f} | {rr[n]['wall_ms'] / rr['bare']['wall_ms']:.3f}")
        if args.json is not None:
            args.json.write_text(json.dumps(gathered, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every file is written. Skip the interpreter's teardown: gloo's threads outlive destroy_process_group
    # while anything still holds the group (DDP, a DeviceMesh, an optimizer), and tearing them down with the
    # interpreter now and then aborts the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
