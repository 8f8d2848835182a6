"""Under torchrun (2 CPU processes, gloo): ``growth_models.attention_logits`` in DDP, each rank its own batches, a
Monitor on every rank. Writes ``<out>/rank<r>.json``: the first failure, the forecasts this rank made, what it said."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import growth_models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=600)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from ampdoctor import Monitor
    from ampdoctor.engine.ring import ForecastWarning

    model, batch, loss_fn, make_opt = growth_models.attention_logits()
    ddp = DistributedDataParallel(model)
    opt = make_opt(ddp.parameters())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Monitor(ddp, opt, torch.amp.GradScaler("cpu"), alert_min_steps=10**9, watch_ops=True) as mon:
            for s in range(a.steps):
                x, y = batch(2 * s + rank)
                with mon.autocast():
                    loss = loss_fn(ddp(x), y)
                mon.step(loss)
                if mon.first_failure is not None:
                    break
    g = mon.lookback.growth
    said = [str(w.message) for w in seen if issubclass(w.category, ForecastWarning)]
    out = {"rank": rank, "failure": list(mon.first_failure) if mon.first_failure else None,
           "warned": {k: [f.step, f.expected_step] for k, f in g.warned.items()},
           "module_warned": mon.lookback.warned.layer if mon.lookback.warned is not None else None, "said": said}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
