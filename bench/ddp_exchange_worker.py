"""One rank of ``bench_callbacks.py --parts ddp``: what the Monitor's per-step rank exchange costs.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/ddp_exchange_worker.py --json OUT.json
        [--rounds 7] [--steps 8] [--warmup 2] [--blocks 32] [--repeats 200]

Each rank (gloo, on the CPU, one torch thread) holds two copies of the same DDP model (a stack of
``--blocks`` x (Linear(64,64) -> LayerNorm -> GELU), batch 32, same initial weights), each with its own
AdamW, GradScaler and ``Monitor(mode="sentinel", full_every=100)``: one with ``distributed=None``
(the exchange on: one all_reduce of a world_size x SLOTS float64 tensor per step) and one with
``distributed=False`` (off). Autocast fp16 + GradScaler in both. The two are stepped interleaved
(on, off, on, off, ...), every step timed with the wall clock (an all_reduce blocks on the slower
rank: CPU time would not see the wait). Then, ``--repeats`` times back to back, interleaved: ``dist.all_reduce``
of that tensor alone, and the sentinel step's whole exchange path alone (``RankExchange.local_row``,
``exchange``, the host copy and ``decode``). Rank 0 writes every rank's medians to ``--json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ampdoctor import Monitor
from ampdoctor.parallel.exchange import SLOTS  # the numbers each rank contributes to the exchange


def build(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)


class Variant:
    def __init__(self, name: str, base: nn.Module, distributed: bool | None, log: Path) -> None:
        self.name = name
        self.model = DDP(copy.deepcopy(base))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        self.mon = Monitor(self.model, self.opt, self.scaler, log=log, log_mode="new", mode="sentinel", full_every=100,
                           distributed=distributed)
        self.times: list[float] = []
        self.step_no = 0

    def step(self, rank: int, keep: bool) -> None:
        x, y = batch(rank, self.step_no)
        t0 = time.perf_counter()
        with self.mon.autocast():
            loss = nn.functional.mse_loss(self.model(x).float(), y)
        self.mon.step(loss)
        dt = time.perf_counter() - t0
        self.step_no += 1
        if keep:
            self.times.append(dt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where rank 0 writes the medians")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before the first round")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=200, help="all_reduce calls timed on their own")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    base = build(a.blocks)
    with tempfile.TemporaryDirectory() as tmp:
        on = Variant("exchange on (distributed=None)", base, None, Path(tmp) / "on.csv")  # -> on.rank{r}.csv
        off = Variant("exchange off (distributed=False)", base, False, Path(tmp) / f"off.rank{rank}.csv")
        assert on.mon.ranks is not None and off.mon.ranks is None
        variants = [on, off]
        for _ in range(a.warmup):  # step 0 is a full step (full_every=100): not timed
            for v in variants:
                v.step(rank, keep=False)
        for _ in range(a.rounds):
            for _ in range(a.steps):
                for v in variants:
                    v.step(rank, keep=True)
        for v in variants:
            v.mon.close()
        full = torch.zeros((world, SLOTS), dtype=torch.float64)
        rx = on.mon.ranks
        ok, nbad, first = torch.tensor(True), torch.tensor(0), torch.tensor(0)
        ar: list[float] = []
        path: list[float] = []
        dist.barrier()
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            dist.all_reduce(full)
            t1 = time.perf_counter()
            rx.decode(rx.exchange(rx.local_row(torch.device("cpu"), ok, nbad, first)).cpu().numpy())
            t2 = time.perf_counter()
            ar.append(t1 - t0)
            path.append(t2 - t1)
    mine = {"rank": rank, "threads": torch.get_num_threads(), "all_reduce": statistics.median(ar),
            "exchange_path": statistics.median(path),
            "params": sum(p.numel() for p in base.parameters()), "modules": sum(1 for _ in base.modules()),
            "skips": [len(v.mon.skips) for v in variants],
            **{v.name: statistics.median(v.times) for v in variants}}
    got: list[dict | None] = [None] * world
    dist.all_gather_object(got, mine)
    if rank == 0:
        Path(a.json).write_text(json.dumps({"world": world, "ranks": got, "load": os.getloadavg()[0], "args": vars(a)}))
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
