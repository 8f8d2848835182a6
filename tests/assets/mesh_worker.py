"""Four CPU ranks (gloo) under torchrun on a 2-D device mesh, each running a Monitor.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/assets/mesh_worker.py MODE OUT

MODE ``fsdp2_tp``: a (dp=2, tp=2) mesh: ``ColwiseParallel`` of ``embed`` and ``RowwiseParallel`` of ``mid`` over
``tp``, then ``fully_shard`` of every Linear and the model over ``dp`` with ``MixedPrecisionPolicy(param_dtype=
float16)`` and ``ShardedGradScaler`` (``norm`` and ``head`` are FSDP's alone: DTensors on the ``dp`` sub-mesh). The
two ``tp`` ranks of a ``dp`` group run one batch; at step 5 rank 3's own part of ``embed``'s output goes NaN (its
local computation: ``mid``'s all-reduce carries it to rank 2 later in the forward, FSDP's reduce-scatter to ranks
0 and 1 in backward). MODE ``hsdp``: ``fully_shard`` on a (replicate=2, shard=2) mesh, same policy and scaler,
every rank its own batch; rank 2's batch holds a NaN at step 5.

Each step the worker takes the engine's own global norm (``full_tensor`` of every gradient, after ``unscale_``:
``ref``). Then phases: ``norm``, the same layout in FP32 for 3 steps of ``mon.step(loss)`` clipping at
``max_norm=0.5`` next to the model unsharded on one process fed every group's batch at once with
``clip_grad_norm_`` (the true global norm, computed without any engine); ``observe``, the loop with and
without a Monitor (bit-identical weights). Each rank writes OUT/result.rank{r}.json. The file is also the spec a
capture replays with (``build_model``, ``loss_fn``).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampdoctor import Monitor

STEPS = 8
BAD_STEP = 5
WORLD = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.mid = nn.Linear(32, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mid(self.act(self.embed(x)))))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def wrap(mode: str, model: nn.Module, low: bool = True) -> nn.Module:
    """The model laid out on the 2-D mesh (``low``: with the float16 policy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    if mode == "fsdp2_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"embed": ColwiseParallel(), "mid": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for sub in (model.embed, model.mid, model.head):
        fully_shard(sub, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)
    return model


def group(mode: str, rank: int) -> int:
    """The batch group of a rank: the ``dp`` coordinate (fsdp2_tp), else the rank."""
    return rank // 2 if mode == "fsdp2_tp" else rank


def groups(mode: str) -> list[int]:
    return sorted({group(mode, r) for r in range(WORLD)})


def batch(g: torch.Generator, mode: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    if mode == "hsdp" and rank == 2 and step == BAD_STEP:
        x[0, 0] = float("nan")
    return x, y


def local_nan(mode: str, model: nn.Module, rank: int, step: list[int]) -> None:
    """fsdp2_tp: rank 3's own part of ``embed``'s output goes NaN at the bad step."""
    if mode != "fsdp2_tp" or rank != 3:
        return

    def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if step[0] != BAD_STEP:
            return None
        bad = torch.zeros_like(out)
        bad[0, 0] = float("nan")
        return out + bad

    model.embed.register_forward_hook(hook)


def engine_norm(model: nn.Module) -> float:
    """The global norm by the engine's own means: every gradient gathered whole (a collective: every rank)."""
    sq = 0.0
    for p in model.parameters():
        if p.grad is not None:
            sq += float(p.grad.full_tensor().double().norm()) ** 2  # type: ignore[attr-defined]
    return math.sqrt(sq)


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]


def norm_phase(mode: str, rank: int) -> list[float]:
    """FP32, 3 steps of ``mon.step(loss)`` clipping at ``max_norm=0.5`` next to the model unsharded on this process fed
    every group's batch at once with ``clip_grad_norm_`` (the true global norm, computed without any engine): [the
    largest relative difference of the logged norm, the largest weight difference at the end]."""
    model = wrap(mode, build_model(), low=False)
    ref = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mon = Monitor(model, opt, max_norm=0.5, alert_min_steps=10**6, quiet=True)
    gens = {k: torch.Generator().manual_seed(300 + k) for k in groups(mode)}
    worst = 0.0
    for _ in range(3):
        data = {k: (torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for k, g in gens.items()}
        x, y = data[group(mode, rank)]
        got = mon.step(loss_fn(model(x), y)).grad_l2_pre_clip
        whole = loss_fn(ref(torch.cat([d[0] for d in data.values()])), torch.cat([d[1] for d in data.values()]))
        whole.backward()
        true = float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5))
        ropt.step()
        ropt.zero_grad(set_to_none=True)
        worst = max(worst, abs(got - true) / true)
    assert mon.off is None, mon.off
    mon.close()
    diff = max(float((a - b.detach()).abs().max()) for a, b in zip(weights(model), ref.parameters(), strict=True))
    return [worst, diff]


def observe_phase(mode: str, rank: int) -> float:
    """Do no harm: the loop with and without a watching Monitor (full statistics, a NaN on rank 1 at step 2): the
    largest weight difference (0.0: bit-identical)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    finals = []
    for watched in (True, False):
        model = wrap(mode, build_model())
        scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = Monitor(model, opt, scaler, alert_min_steps=10**6, quiet=True) if watched else None
        g = torch.Generator().manual_seed(200 + group(mode, rank))
        for step in range(4):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if group(mode, rank) == 1 and step == 2:
                x[0, 0] = float("nan")
            loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            if mon is not None:
                mon.after_backward(loss, batch=(x, y))
            scaler.step(opt)
            scaler.update()
            if mon is not None:
                mon.after_step()
            opt.zero_grad(set_to_none=True)
        if mon is not None:
            assert mon.off is None, mon.off
            mon.close()
        finals.append(weights(model))
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(*finals, strict=True))


def main() -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = wrap(mode, build_model())
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    at = [0]
    local_nan(mode, model, rank, at)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refs: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = Monitor(model, opt, scaler, log=out / "steps.csv", capture=out / "cap", alert_min_steps=10**6)
        g = torch.Generator().manual_seed(group(mode, rank))
        for step in range(STEPS):
            at[0] = step
            x, y = batch(g, mode, step, rank)
            loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            refs.append(engine_norm(model))
            mon.after_backward(loss, batch=(x, y))
            scaler.step(opt)
            scaler.update()
            mon.after_step()
            opt.zero_grad(set_to_none=True)
            if step == BAD_STEP:
                full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
                if rank == 0:
                    torch.save(full, out / "full.pt")  # the whole weights after the (skipped) bad step
    mon.close()
    ff = mon.first_fault
    res = {"off": mon.off, "ref": refs, "engine": mon.engine,
           "first_fault": None if ff is None else [ff.step, ff.rank, ff.kind, ff.module, ff.others_clean],
           "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "ampdoctor" in str(w.message)],
           "norm_phase": norm_phase(mode, rank), "observe_diff": observe_phase(mode, rank)}
    (out / f"result.rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _job import end_job

    main()
    end_job()
