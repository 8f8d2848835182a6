"""One CPU process over gloo (world 1) per setup; prints a JSON line per setup: the ampdoctor warnings (category,
text), whether the monitor is off, and that the training went on. ``hsdp`` (a (1, 1) mesh) is read; ``hsdp_tp`` (a
3-D mesh) and ``fsdp1_flat`` are not yet.

    python tests/assets/unsupported_worker.py hsdp hsdp_tp fsdp1_flat
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ampdoctor import Monitor


def model_for(setup: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    if setup == "hsdp":  # a 2-D mesh: (replicate, shard), HSDP's placements (Replicate(), Shard(0))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        return model
    if setup == "hsdp_tp":  # a 3-D mesh: HSDP over (replicate, shard) of a tensor-parallel model over tp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("replicate", "shard", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["replicate", "shard"])
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, use_orig_params=False, device_id=torch.device("cpu"))


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 200))
    dist.init_process_group("gloo", rank=0, world_size=1)
    for setup in sys.argv[1:]:
        model = model_for(setup)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            mon = Monitor(model, opt, log=None)
            losses = []
            for _ in range(3):
                loss = model(torch.randn(2, 4)).pow(2).mean()
                loss.backward()
                mon.after_backward(loss)
                opt.step()
                mon.after_step()
                opt.zero_grad()
                losses.append(float(loss))
            mon.close()
        print(json.dumps({"setup": setup, "off": mon.off, "steps": len(losses),
                          "said": [[w.category.__name__, str(w.message)] for w in said if "ampdoctor" in str(w.message)]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    from _job import end_job

    main()
    end_job()
