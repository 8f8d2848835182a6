"""What the Python hooks alone cost per training step (issue 14), statistics stubbed out.

    python bench/bench_hooks.py [--models deep_mlp,gpt,word_lm] [--rounds 7] [--steps 3] [--threads N]

One process, variants interleaved, each with its own copy of the model, AdamW and GradScaler;
autocast fp16. Variants:

- ``bare``: the AMP step;
- ``module hooks, no-op`` / ``global hook, no-op``: one do-nothing forward hook per module, against
  one process-wide ``register_module_forward_hook`` (what dispatching a hook costs at all);
- ``Hooks per module``: ``ampdoctor.Hooks`` as it was before issue 14 (a forward hook registered on
  every module), statistics stubbed (tensors queued into a buffer that drops them);
- ``Hooks global``: ``ampdoctor.Hooks`` now, same stub (named for issue 14's first step, one global hook;
  since then module calls are seen through a wrapper of ``nn.Module.__call__`` and recorded in C++ once
  the kernel is built: ``AMPDOCTOR_MODULE_HOOK=global`` and ``AMPDOCTOR_FUSED=0`` bring back each older way);
- ``Hooks global, not recorded``: the same on steps it does not record (every=10**9): no hook at all.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch
import torch.nn.modules.module as tmod
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, loss_fn  # noqa: E402

from ampdoctor.records import NCOLS
from ampdoctor.watch.hooks import Hooks  # noqa: E402

CLOCK = time.perf_counter
"""What a step is timed with (--clock)."""


class NullBuffer:
    """Takes every tensor, computes nothing (the statistics stubbed out)."""

    flush_numel = 1 << 22

    def add(self, key: Hashable, tensor: torch.Tensor) -> None:
        pass

    def add_many(self, keys: list[Hashable], tensors: list[torch.Tensor], numel: int, mixed: bool = False) -> None:
        pass

    def collect(self) -> tuple[list[Hashable], torch.Tensor]:
        return [], torch.zeros((0, NCOLS), dtype=torch.float64)


class PerModuleHooks(Hooks):
    """Hooks with the pre-issue-14 registration: one forward hook on every module."""

    def _sync_hook(self) -> None:
        want = self._attached and self._active
        if want and not self._handles:
            for m in self.model.modules():
                self._handles.append(m.register_forward_hook(self._fwd, with_kwargs=True))
        elif not want and self._handles:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def _fwd(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.after_call(module, args, kwargs, output)


def _noop(*_: Any) -> None:
    return None


class Variant:
    def __init__(self, name: str, model: nn.Module) -> None:
        self.name = name
        self.model = copy.deepcopy(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        self.times: list[float] = []
        self.hooks: Hooks | None = None
        self.handles: list[Any] = []
        if name.startswith("Hooks"):
            cls = PerModuleHooks if "per module" in name else Hooks
            self.hooks = cls(self.model, every=10**9 if "not recorded" in name else 1)
            self.hooks._buf = NullBuffer()  # type: ignore[assignment]

    def _on(self) -> None:
        if self.name == "module hooks, no-op":
            self.handles = [m.register_forward_hook(_noop, with_kwargs=True) for m in self.model.modules()]
        elif self.name == "global hook, no-op":
            self.handles = [tmod.register_module_forward_hook(_noop, with_kwargs=True)]
        elif self.hooks is not None:
            self.hooks.attach()

    def _off(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.hooks is not None:
            self.hooks.detach()

    def step(self, x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        self._on()  # outside the timing: each variant's hooks exist only while it runs
        t0 = CLOCK()
        if self.hooks is not None:
            self.hooks.begin_step(i if "not recorded" not in self.name else 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        if self.hooks is not None:
            self.hooks.after_backward()
            self.hooks.end_step()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.times.append(CLOCK() - t0)
        self._off()


NAMES = ["bare", "module hooks, no-op", "global hook, no-op", "Hooks per module", "Hooks global",
         "Hooks global, not recorded"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="deep_mlp,gpt,word_lm")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (time.process_time), steadier on a shared machine")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, clock {a.clock}, load average {os.getloadavg()[0]:.1f}, {torch.get_num_threads()} threads; {a.rounds} rounds x {a.steps} steps, "
          "interleaved; medians")
    for mname in a.models.split(","):
        torch.manual_seed(0)
        model, make_batch = MODELS[mname]()
        g = torch.Generator().manual_seed(0)
        batches = [make_batch(g) for _ in range(4)]
        vs = [Variant(n, model) for n in NAMES]
        for v in vs:
            for k in range(2):
                v.step(*batches[k], k)
            v.times.clear()
        i = 0
        for _ in range(a.rounds):
            for v in vs:
                for _ in range(a.steps):
                    v.step(*batches[i % 4], i)
                    i += 1
        base = statistics.median(vs[0].times)
        print(f"\n{mname} ({sum(1 for _ in model.modules())} modules)")
        for v in vs:
            m = statistics.median(v.times)
            print(f"  {v.name:28} {m * 1e3:9.2f} ms {m / base:6.3f}")


if __name__ == "__main__":
    main()
