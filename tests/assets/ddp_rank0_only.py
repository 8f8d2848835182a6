"""DDP (2 gloo ranks) with a Monitor on rank 0 only, the common log-on-rank-0 pattern: it must not
hang in the exchange. Used by tests/test_distributed.py."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ampdoctor import Monitor


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = None
    if rank == 0:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            mon = Monitor(model, opt, log=out / "steps.csv")
        (out / "warning.txt").write_text("\n".join(str(w.message) for w in got))
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        if mon is not None:
            mon.after_backward(loss)
        opt.step()
        if mon is not None:
            mon.after_step()
        opt.zero_grad()
    if mon is not None:
        mon.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _job import end_job

    main()
    end_job()
