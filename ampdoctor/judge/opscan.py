"""Find the operation inside a module whose FP32 output first exceeds a format's range.

Hooks see module boundaries only; an overflow inside a functional op (``q @ k.transpose(-2, -1)``
inside ``attn``) needs a look inside. This replays one forward under a TorchFunctionMode that is
active only while the named module runs, and records every op's finite absmax. Used once, at
diagnosis time, never in the training loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ampdoctor.formats import FP16, Format
from ampdoctor.tensors import iter_tensors


@dataclass
class OpRecord:
    index: int
    op: str
    absmax: float
    overflow_frac: float
    """Share of the output's elements at or beyond FP16's overflow threshold."""
    numel: int


class _Scan(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.ops: list[OpRecord] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.depth > 0:
            name = getattr(func, "__name__", str(func))
            if name not in ("__get__", "__set__", "size", "dim", "__len__"):
                vals = [t for t in iter_tensors(out) if t.is_floating_point() and t.numel()]
                if vals:
                    with torch._C.DisableTorchFunction():
                        a = [torch.nan_to_num(t.detach().float(), 0.0, 0.0, 0.0).abs() for t in vals]
                        amax = max(float(x.max()) for x in a)
                        numel = sum(x.numel() for x in a)
                        over = sum(int((x >= FP16.overflow_threshold).sum()) for x in a)
                    self.ops.append(OpRecord(len(self.ops), name.strip("_"), amax, over / numel, numel))
        return out


def scan_module(model: nn.Module, module_name: str, run: Callable[[], Any]) -> list[OpRecord]:
    """Run ``run()`` (a forward of ``model``) and return the ops executed inside ``module_name``."""
    target = dict(model.named_modules()).get(module_name)
    if target is None:
        return []
    scan = _Scan()

    def enter(*_: Any) -> None:
        scan.depth += 1

    def leave(*_: Any) -> None:
        scan.depth -= 1

    h1 = target.register_forward_pre_hook(enter)
    h2 = target.register_forward_hook(leave)
    try:
        with torch.no_grad(), scan:
            run()
    except Exception:
        return scan.ops
    finally:
        h1.remove()
        h2.remove()
    return scan.ops


def first_overflowing_op(ops: list[OpRecord], fmt: Format = FP16) -> OpRecord | None:
    """The first op whose FP32 output has a finite value at or beyond the format's overflow threshold."""
    return next((o for o in ops if o.absmax >= fmt.overflow_threshold), None)
