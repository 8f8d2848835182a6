"""A DDP run in which one rank gets a bad batch: which rank, which module, which step.

Two ranks train a small MLP with AMP + GradScaler under DDP (gloo, on the CPU). At step 5 rank 1's
batch holds an Inf. DDP all-reduces the gradients, so every rank's GradScaler sees the Inf and skips
the step: from the scale alone, or from rank 0's log, every rank looks equally guilty. A Monitor on
each rank exchanges one small all-reduce per step and every rank's log says it was rank 1, its input,
read first by ``embed``, at step 5, with rank 0 clean; rank 1 writes the capture:

    torchrun --standalone --nproc-per-node 2 sample_models/ddp_bad_batch.py --out run
    ampdoctor scaler run/steps.rank0.csv run/steps.rank1.csv       # the ranks side by side
    ampdoctor triage sample_models/ddp_bad_batch.py --from run/cap.rank1   # data_nonfinite

As a spec (for ``triage --from``) it defines build_model and loss_fn; run as a script it is the
user's own DDP loop.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

BAD_STEP = 5
BAD_RANK = 1


class Model(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), target)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    if rank == BAD_RANK and step == BAD_STEP:
        x[3, 7] = float("inf")  # one bad sample on one rank
    return x, y


def main() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ampdoctor import Monitor

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="ddp-run", help="folder for the per-rank logs and the capture")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--mode", choices=["full", "sentinel"], default="full")
    ap.add_argument("--capture-ranks", choices=["first", "all"], default="first")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = DDP(build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with Monitor(model, opt, scaler, log=out / "steps.csv", log_mode="new", capture=out / "cap", snapshot_every=4,
                 mode=a.mode, full_every=4, capture_ranks=a.capture_ranks) as mon:
        for step in range(a.steps):
            x, y = batch(rank, step)
            with mon.autocast():
                loss = loss_fn(model(x), y)
            mon.step(loss, batch=(x, y))
        if mon.first_fault is not None and rank == 0:
            print(f"rank {rank}: {mon.first_fault.describe()}")
    dist.barrier()
    dist.destroy_process_group()
    if os.environ.get("AMPDOCTOR_DDP_DONE"):
        Path(os.environ["AMPDOCTOR_DDP_DONE"]).with_suffix(f".{rank}").write_text("ok")


if __name__ == "__main__":
    main()
    # Every file is written. Skip the interpreter's teardown: gloo's threads outlive destroy_process_group
    # while anything still holds the group (DDP, a DeviceMesh, an optimizer), and tearing them down with the
    # interpreter now and then aborts the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
