"""One CPU process over gloo (world 1): a tensor-parallel plan recorded by ``parallel.tp.recipe`` and rebuilt
on a fresh model by ``rebuild``; prints one JSON line.

    python tests/assets/tp_layout_worker.py
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from ampdoctor.parallel import tp as tp_layout
from ampdoctor.report.stages import layout


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(4)
        self.scale = nn.Parameter(torch.ones(4))  # placed by hand (distribute_tensor), no style


def build(mesh: object, sequence: bool) -> nn.Module:
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    torch.manual_seed(0)
    m = Net()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Replicate(), use_local_output=False)}
    if sequence:
        plan["norm"] = SequenceParallel()
    parallelize_module(m, mesh, plan)  # type: ignore[arg-type]
    m.scale = nn.Parameter(distribute_tensor(m.scale.detach(), mesh, [Replicate()]))  # type: ignore[arg-type]
    return m


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 400))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    rec = tp_layout.recipe(build(mesh, sequence=False))
    assert rec is not None
    fresh = Net()
    fresh.load_state_dict(Net().state_dict())
    tp_layout.rebuild(fresh, rec, mesh)
    again = tp_layout.recipe(fresh)
    wrong = json.loads(json.dumps(rec))
    wrong["placements"]["up.weight"] = ["S(1)"]
    try:
        tp_layout.rebuild(Net(), wrong, mesh)
        said = ""
    except Exception as e:
        said = str(e)
    seq = tp_layout.recipe(build(mesh, sequence=True))
    assert seq is not None
    print(json.dumps({"recipe": rec, "again": again, "wrong": said, "sequence": seq["unsupported"],
                      "refusal": tp_layout.refusal(seq), "words": layout(rec), "fine": tp_layout.refusal(rec)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    from _job import end_job

    main()
    end_job()
