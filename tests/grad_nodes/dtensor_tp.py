"""One process, a 1-rank DeviceMesh over gloo: a two-layer MLP under tensor parallelism (ColwiseParallel,
RowwiseParallel), its weights DTensors, with ``sqrt`` of a ReLU'd activation in the root's code: sqrt's gradient at 0
is Inf. Prints the first non-finite autograd node ``judge.gradnode`` finds, then what ``torch.autograd.detect_anomaly``
does on the same backward. Run by tests/test_gradnode.py as a subprocess (its own process group)."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ampdoctor.judge.gradnode import first_nonfinite_grad


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x):
        return self.down(self.up(x).clamp_min(0).sqrt())


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = parallelize_module(MLP(), init_device_mesh("cpu", (1,)), {"up": ColwiseParallel(), "down": RowwiseParallel()})
        x = torch.randn(3, 4)
        print("weight", type(model.up.weight).__name__)
        node = first_nonfinite_grad(model, lambda: model(x).pow(2).mean())
        print("node", node.node if node else None, node.op if node else None, node.module if node else None,
              node.line if node else None)
        try:
            with torch.autograd.detect_anomaly():
                model(x).pow(2).mean().backward()
            print("anomaly none")
        except Exception as e:  # noqa: BLE001
            print("anomaly", type(e).__name__)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
