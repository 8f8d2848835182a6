"""Two CPU ranks (gloo) under torchrun, each running a Monitor on a sharded or failing setup.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/assets/sharded_worker.py MODE OUT

MODE ``fsdp1``: FullyShardedDataParallel (use_orig_params, fp16 MixedPrecision, ShardedGradScaler), a
NaN in rank 1's batch at step 3, a capture armed: the bad rank writes its own shard with no collective,
the job finishes. ``fsdp2``: fully_shard: the monitor turns itself off with one warning per rank and the
training goes on. ``fail``: DDP; rank 1's monitor raises inside its statistics at step 2: every rank's
monitor turns off at that step (rank 1 still joins the step's exchange), no rank hangs, training goes on.
Each rank writes OUT/result.rank{r}.json: steps trained, whether the weights are finite, the monitor's
``off``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ampdoctor import Monitor


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"),
                                         mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16))
        scaler: torch.amp.GradScaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        for sub in model:
            if isinstance(sub, nn.Linear):
                fully_shard(sub)
        fully_shard(model)
        scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    else:
        model = nn.parallel.DistributedDataParallel(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = Monitor(model, opt, scaler, log=out / "steps.csv", capture=out / "cap")
        if mode == "fail" and rank == 1:
            real = mon.hooks.after_backward

            def flaky(*a: object, **k: object) -> None:
                if mon.step_num == 2:
                    raise RuntimeError("statistics exploded on rank 1")
                real(*a, **k)

            mon.hooks.after_backward = flaky  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(rank)
        steps = 0
        for step in range(8):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if rank == 1 and step == 3:
                x[0, 0] = float("nan")
            out_ = model(x)
            loss = nn.functional.mse_loss(out_.float(), y)
            scaler.scale(loss).backward()
            mon.after_backward(loss)
            scaler.step(opt)
            scaler.update()
            mon.after_step()
            opt.zero_grad(set_to_none=True)
            steps += 1
    mon.close()
    finite = all(bool(torch.isfinite(p.detach().to_local() if hasattr(p, "to_local") else p).all()) for p in model.parameters())
    (out / f"result.rank{rank}.json").write_text(json.dumps({
        "steps": steps, "finite": finite, "off": mon.off,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "ampdoctor" in str(w.message)],
        "pid": os.getpid()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
