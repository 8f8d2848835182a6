"""Under torchrun, one process per machine builds the kernel; every rank keeps stepping and loads the build.

    TORCH_EXTENSIONS_DIR=$(mktemp -d) torchrun --standalone --nproc_per_node 2 bench/bench_build_ranks.py

Each rank prints whether it started a builder, whose build it loaded, and how many steps it took meanwhile.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from ampdoctor import Monitor
from ampdoctor.watch import fused

dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(64, 64), nn.GELU())])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mon = Monitor(model, opt, torch.amp.GradScaler("cpu"), quiet=True, distributed=False)
kind = fused._state["proc"]
kind = "builder" if hasattr(kind, "poll") else str(kind)
t0 = time.monotonic()
steps = 0
ready_at = None
while time.monotonic() - t0 < 420:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(32, 64)).float().pow(2).mean()
    mon.step(loss)
    steps += 1
    if fused._state["module"] is not None and ready_at is None:
        ready_at = time.monotonic() - t0
        break
end = fused._state["proc"]
end = "its own build" if end is False else ("another process's build" if end == "elsewhere" else str(end))
print(f"rank {dist.get_rank()}: started a {kind}, loaded {end}; {steps} steps before the kernel was ready; ready after {ready_at}", flush=True)
mon.close()
dist.destroy_process_group()
# (gloo's threads outlive destroy_process_group while the optimizer holds the group: skip the teardown that can
# abort, see docs/frameworks.md)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
