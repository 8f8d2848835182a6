"""Two CPU ranks (gloo) under torchrun, each running a Monitor on a sharded or failing setup.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/assets/sharded_worker.py MODE OUT [MONITOR_MODE]

MODE ``fsdp2``: ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=float16)`` and ``ShardedGradScaler``;
``fsdp2_bf16``: the same in bf16 without a scaler; ``fsdp1``: ``FullyShardedDataParallel(use_orig_params=True)``
with fp16 ``MixedPrecision`` and ``ShardedGradScaler``; ``tp``: ``ColwiseParallel``/``RowwiseParallel`` on a
1-D mesh (every rank the same batch). A NaN at step 5 on rank 1: in its batch (FSDP), or in its local part of
``embed``'s output (TP: the next layer's all-reduce carries it to rank 0). Each step the worker takes
``clip_grad_norm_``'s value itself (``ref``) and the monitor watches (full statistics, or ``MONITOR_MODE=sentinel``).
Then a second phase (FSDP): the same model trained with ``mon.step(loss, max_norm=0.5)`` next to PyTorch's recipe
with the engine's clip: the weights must agree. ``fail``: DDP; rank 1's monitor raises inside its statistics at
step 2: every rank's monitor turns off at that step, no rank hangs, training goes on.

Each rank writes OUT/result.rank{r}.json. The file is also the spec that replays the capture
(``build_model``: the model unwrapped, ``loss_fn``).
"""

from __future__ import annotations

import json
import math
import os
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


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.mid = nn.Linear(32, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.act(self.embed(x))))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def wrap(mode: str, model: nn.Module) -> tuple[nn.Module, Any]:
    """The model under the engine, and its scaler (None in bf16)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dt = torch.bfloat16 if mode.endswith("bf16") else torch.float16
        mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32)
        for sub in (model.embed, model.mid, model.head):
            fully_shard(sub, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, (None if dt == torch.bfloat16 else ShardedGradScaler("cpu", init_scale=2.0**10))
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"),
                                         auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                         mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32))
        return model, ShardedGradScaler("cpu", init_scale=2.0**10)
    if mode == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        from torch.distributed.tensor import Replicate

        # every parameter a DTensor (GradScaler's unscale_ takes no mix): head's input is replicated, its bias too
        parallelize_module(model, mesh, {"embed": ColwiseParallel(), "mid": RowwiseParallel(),
                                         "head": RowwiseParallel(input_layouts=Replicate())})
        return model, torch.amp.GradScaler("cpu", init_scale=2.0**10)  # (the ranks' gradients agree after the all-reduce)
    return nn.parallel.DistributedDataParallel(model), torch.amp.GradScaler("cpu", init_scale=2.0**10)


def total_norm(model: nn.Module) -> float:
    """The global gradient norm as PyTorch's engines compute it (``clip_grad_norm_`` with no clipping)."""
    if isinstance(model, nn.Module) and type(model).__name__ == "FullyShardedDataParallel":
        return float(model.clip_grad_norm_(math.inf))  # type: ignore[operator]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if any(type(g).__name__ == "DTensor" for g in grads) and not all(type(g).__name__ == "DTensor" for g in grads):
        # a tensor-parallel model with plain (replicated) parameters: the DTensors' norms whole, the rest as they are
        sq = sum(float(g.full_tensor().float().norm()) ** 2 if type(g).__name__ == "DTensor" else float(g.float().norm()) ** 2
                 for g in grads)
        return math.sqrt(sq)
    n = torch.nn.utils.clip_grad_norm_(list(model.parameters()), math.inf)
    return float(n.full_tensor() if hasattr(n, "full_tensor") else n)


def batch(g: torch.Generator, mode: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    if mode != "tp" and rank == 1 and step == BAD_STEP:
        x[0, 0] = float("nan")
    return x, y


def local_nan(mode: str, model: nn.Module, rank: int, step: list[int]) -> None:
    """TP: rank 1's own part of ``embed``'s output goes NaN at the bad step (its local computation)."""
    if mode != "tp" or rank != 1:
        return

    def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if step[0] != BAD_STEP:
            return None
        bad = torch.zeros_like(out)
        bad[0, 0] = float("nan")
        return out + bad

    model.embed.register_forward_hook(hook)


def full_weights(mode: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights under the user's names, gathered by the engine's own means."""
    from ampdoctor.watch.model_view import user_name

    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return {user_name(n): p.detach().clone() for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def clip_phase(mode: str, rank: int) -> float | None:
    """``mon.step(loss, max_norm=...)`` against PyTorch's recipe with the engine's clip: the largest weight difference."""
    if mode not in ("fsdp1", "fsdp2"):
        return None
    finals = []
    for watched in (True, False):
        model, scaler = wrap(mode, build_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = Monitor(model, opt, scaler, max_norm=0.5, alert_min_steps=10**6) if watched else None
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(4):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            loss = loss_fn(model(x), y)
            if mon is not None:
                mon.step(loss)
                continue
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if mode == "fsdp1":
                model.clip_grad_norm_(0.5)  # type: ignore[operator]
            else:
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        if mon is not None:
            assert mon.off is None, mon.off
            mon.close()
        finals.append(weights(model))
    return max(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0 for a, b in zip(*finals, strict=True))


def observe_phase(mode: str, rank: int) -> float | None:
    """Do no harm: the same loop with and without a watching Monitor (full statistics, a NaN on rank 1 at step 2):
    the largest weight difference (0.0: bit-identical)."""
    if mode == "fail":
        return None
    finals = []
    for watched in (True, False):
        model, scaler = wrap(mode, build_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = Monitor(model, opt, scaler, alert_min_steps=10**6, quiet=True) if watched else None
        g = torch.Generator().manual_seed(200 + (0 if mode == "tp" else rank))
        for step in range(4):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if rank == 1 and step == 2:
                x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is None):
                loss = loss_fn(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if mon is not None:
                mon.after_backward(loss, batch=(x, y))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                bad = torch.tensor([0.0 if math.isfinite(float(loss)) else 1.0])
                dist.all_reduce(bad)
                if not bad.item():
                    opt.step()
            if mon is not None:
                mon.after_step()
            opt.zero_grad(set_to_none=True)
        if mon is not None:
            assert mon.off is None, mon.off
            mon.close()
        finals.append(weights(model))
    return max(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0 for a, b in zip(*finals, strict=True))


def alone_phase(mode: str, rank: int) -> list[Any] | None:
    """``Monitor(distributed=False)`` on a sharded model: no exchange, so no global norm (the log leaves it out);
    it must watch without raising. Returns [off, the logged norms]."""
    if mode in ("fail", "tp"):
        return None
    model, scaler = wrap(mode, build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt, scaler, distributed=False, quiet=True, alert_min_steps=10**6)
    g = torch.Generator().manual_seed(rank)
    norms = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is None):
            loss = loss_fn(model(torch.randn(16, 8, generator=g)), torch.randn(16, 1, generator=g))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        mon.after_backward(loss)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        norms.append(mon.after_step().grad_l2_pre_clip)
        opt.zero_grad(set_to_none=True)
    mon.close()
    return [mon.off, norms]


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    mon_mode = sys.argv[3] if len(sys.argv) > 3 else "full"
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, scaler = wrap(mode, build_model())
    at = [0]
    local_nan(mode, model, rank, at)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refs: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = Monitor(model, opt, scaler, log=out / "steps.csv", capture=out / "cap", mode=mon_mode,  # type: ignore[arg-type]
                      full_every=4, amp_dtype=torch.bfloat16 if scaler is None else None, alert_min_steps=10**6)
        if mode == "fail" and rank == 1:
            real = mon.hooks.after_backward

            def flaky(*a: object, **k: object) -> None:
                if mon.step_num == 2:
                    raise RuntimeError("statistics exploded on rank 1")
                real(*a, **k)

            mon.hooks.after_backward = flaky  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(0 if mode == "tp" else rank)  # TP: every rank the same batch
        steps = 0
        for step in range(STEPS):
            at[0] = step
            x, y = batch(g, mode, step, rank)
            with mon.autocast() if scaler is None else torch.autocast("cpu", enabled=False):
                loss = loss_fn(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            refs.append(total_norm(model))
            mon.after_backward(loss, batch=(x, y))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            elif not mon.should_skip:
                opt.step()
            mon.after_step()
            opt.zero_grad(set_to_none=True)
            steps += 1
            if step == BAD_STEP and mode != "fail":
                full = full_weights(mode, model)  # (a collective: every rank)
                if rank == 0:
                    torch.save(full, out / "full.pt")  # the whole weights after the (skipped) bad step
    mon.close()
    finite = all(bool(torch.isfinite(p.detach().to_local() if hasattr(p, "to_local") else p).all()) for p in model.parameters())
    clip = clip_phase(mode, rank)
    harm = observe_phase(mode, rank)
    alone = alone_phase(mode, rank)
    drift: list[str] = []
    if mode == "fsdp1":  # a plain GradScaler under FSDP1: each rank's skip from its own shard
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            Monitor(model, opt, torch.amp.GradScaler("cpu")).close()
        drift = [str(w.message) for w in said if "ampdoctor" in str(w.message)]
    (out / f"result.rank{rank}.json").write_text(json.dumps({
        "steps": steps, "finite": finite, "off": mon.off, "ref": refs, "clip_diff": clip, "drift": drift, "observe_diff": harm, "alone": alone,
        "first_fault": None if mon.first_fault is None else [mon.first_fault.step, mon.first_fault.rank,
                                                             mon.first_fault.kind, mon.first_fault.module],
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "ampdoctor" in str(w.message)],
        "pid": os.getpid()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _job import end_job

    main()
    end_job()
