"""A DeepSpeed ZeRO run on the CPU, 2 processes over gloo, watched by ``ampdoctor.integrations.deepspeed``
or not (``--bare``), for tests/test_integration_deepspeed.py. It is its own spec (``build_model``,
``build_dataloader``, ``loss_fn``), which triage reads without DeepSpeed installed: DeepSpeed is imported
in ``main`` only.

Rank 1's (first micro-)batch holds a NaN at step ``--nan-step``; at ``--overflow-step`` every rank's loss is multiplied by
1e10, so the FP16 gradients overflow. Writes, per rank, ``ds.rank<r>.json`` (DeepSpeed's own norm, scale
and skip every step) and ``final.rank<r>.pt`` (the engine's state after the run: weights, FP32 master
partitions, optimizer state, loss scaler, RNG)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.act(self.embed(x))))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def build_dataloader() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch(0, s) for s in range(4)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def count_reductions() -> list[int]:
    """The size of every all-reduce ampdoctor's DeepSpeed integration runs (its own calls only), in order."""

    import torch.distributed as dist

    sizes: list[int] = []
    real = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_globals.get("__name__") == "ampdoctor.integrations.deepspeed":
            sizes.append(int((args[0] if args else kwargs["tensor"]).numel()))
        return real(*args, **kwargs)

    dist.all_reduce = counted  # type: ignore[assignment]
    return sizes


def zero3(engine: Any, out: Path, rank: int, low: torch.dtype) -> None:
    import warnings

    from ampdoctor.integrations.deepspeed import watch

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mon = watch(engine, log=out / "steps.csv", capture=out / "cap")
        losses = []
        for step in range(3):
            x, y = batch(rank, step)
            loss = loss_fn(engine(x.to(low)), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        mon.close()
    (out / f"zero3.rank{rank}.json").write_text(json.dumps({
        "off": mon.off, "losses": losses, "files": sorted(p.name for p in out.iterdir()),
        "said": [[w.category.__name__, str(w.message)] for w in said if "ampdoctor" in str(w.message)]}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--prec", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nan-step", type=int, default=5)
    ap.add_argument("--overflow-step", type=int, default=-1)
    ap.add_argument("--hysteresis", type=int, default=2)
    ap.add_argument("--gas", type=int, default=1, help="gradient accumulation steps (micro-batches per step)")
    ap.add_argument("--keep-batch", action="store_true", help="give the monitor each micro-batch (x, y)")
    ap.add_argument("--bare", action="store_true")
    ap.add_argument("--mode", default="full", choices=["full", "sentinel"], help="the monitor's mode (sentinel: full_every=4)")
    ap.add_argument("--direct-backward", action="store_true", help="loss.backward() instead of engine.backward(loss)")
    a = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # the CPU accelerator says FP16 is unsupported unless oneDNN has FP16 kernels; it runs all the same here
    type(get_accelerator()).is_fp16_supported = lambda self: True  # type: ignore[method-assign]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model()
    cfg: dict = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": a.gas, "steps_per_print": 10**6,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.01}},
                 "zero_optimization": {"stage": a.stage}, "gradient_clipping": 1.0, "wall_clock_breakdown": False}
    if a.prec == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 1000, "hysteresis": a.hysteresis,
                       "min_loss_scale": 1}
    else:
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = engine.global_rank
    if a.stage == 3:  # not read yet: watch turns the monitor off with one warning and the loop trains on
        zero3(engine, out, rank, low=torch.float16 if a.prec == "fp16" else torch.bfloat16)
        return
    mon = None
    if not a.bare:
        from ampdoctor.integrations.deepspeed import watch

        reduced = count_reductions()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            mon = watch(engine, log=out / "steps.csv", capture=out / "cap", quiet=not a.direct_backward, mode=a.mode,
                        full_every=4)
    low = torch.float16 if a.prec == "fp16" else torch.bfloat16
    rows = []
    torch.manual_seed(1 + rank)  # dropout: each rank its own draws
    ls = getattr(engine.optimizer, "loss_scaler", None)
    for step in range(a.steps):
        scale_before = float(ls.cur_scale) if ls is not None else None
        if step == a.nan_step:  # the whole state as this step begins (every rank joins DeepSpeed's gathers)
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            whole = {n: {"fp32": safe_get_full_fp32_param(p).detach().clone(),
                         "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone(),
                         "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone()}
                     for n, p in engine.module.named_parameters()}
            torch.save(whole, out / f"whole.step{step}.rank{rank}.pt")
        for micro in range(a.gas):  # engine.step() at every micro-batch: DeepSpeed steps at the boundary
            x, y = batch(rank, step * a.gas + micro)
            if step == a.nan_step and rank == 1 and micro == 0:
                x[0, 3] = float("nan")
            if mon is not None and a.keep_batch:
                mon.keep_batch((x, y))  # the capture replays whole steps (else the forward alone)
            loss = loss_fn(engine(x.to(low)), y)
            if step == a.overflow_step:
                loss = loss * 1e10
            if a.direct_backward:
                loss.backward()
            else:
                engine.backward(loss)
            with warnings.catch_warnings(record=True) as said_now:
                warnings.simplefilter("always")
                engine.step()
            if mon is not None:
                said.extend(said_now)
        n = engine.get_global_grad_norm()
        rows.append({"step": step, "norm": None if n is None else float(n), "applied": bool(engine.was_step_applied()),
                     "scale_before": scale_before, "scale_after": float(ls.cur_scale) if ls is not None else None,
                     "hysteresis": int(getattr(ls, "cur_hysteresis", 0) or 0), "skipped_steps": int(engine.skipped_steps),
                     "loss": float(loss.detach())})
    if mon is not None:
        mon.close()
        (out / f"watch.rank{rank}.json").write_text(json.dumps({
            "reduced": reduced, "said": [[w.category.__name__, str(w.message)] for w in said if "ampdoctor" in str(w.message)]}))
    (out / f"ds.rank{rank}.json").write_text(json.dumps(rows))
    o = engine.optimizer
    final = {
        "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "fp32": [t.detach().clone() for t in o.single_partition_of_fp32_groups],
        "optimizer": o.optimizer.state_dict(),
        "scaler": {k: v for k, v in vars(ls).items() if isinstance(v, (int, float, bool))} if ls is not None else None,
        "skipped_steps": int(engine.skipped_steps), "global_steps": int(engine.global_steps),
        "rng": torch.get_rng_state(),
    }
    torch.save(final, out / f"final.rank{rank}.pt")
    torch.distributed.destroy_process_group()  # without it gloo can abort the job at exit (see docs/frameworks.md)


if __name__ == "__main__":
    from _job import end_job

    main()
    end_job()
