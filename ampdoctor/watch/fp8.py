"""Per-GEMM FP8 operand statistics of a model converted by torchao (``Float8Linear``).

Each ``Float8Linear`` runs three GEMMs a step from three operands it casts to FP8: its input and weight
(forward, E4M3) and its output gradient (backward, E5M2 in the tensorwise recipe, E4M3 in the rowwise
ones). ``GemmObserver`` reads each operand where the layer gets it (a forward pre-hook: the input and
the weight; a hook on the output tensor: the output gradient) and reduces it with the layer's own cast
settings (``scaled.operand_stats``: amax, the scale torchao derives, saturated / flushed / NaN shares,
SQNR against the high-precision value, the worst row of a rowwise recipe). The hooks read and return
nothing: the run is unchanged. No torchao import: the layers are found by their class name and read
through their ``config`` (``Float8LinearConfig``).

The rows of a step are stacked on the device and copied to the host once, at ``end_step``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.formats import FP8_E4M3, FP8_E5M2, Format
from ampdoctor.scaled import AMAX_FLOOR, OPERAND_FIELDS, GemmRow, operand_stats

OPERANDS = ("input", "weight", "grad_output")
"""The operands of a Float8Linear's GEMMs, in the order a step meets them."""


@dataclass(frozen=True)
class Cast:
    """How a layer casts one operand: the format, one scale per row or per tensor, scales rounded to a power of two."""

    fmt: Format
    rowwise: bool
    pow2: bool
    enabled: bool = True

    def describe(self) -> str:
        return "off" if not self.enabled else f"{self.fmt.name}/{'rowwise' if self.rowwise else 'tensorwise'}"


def amax_floor() -> float:
    """The amax floor torchao's cast uses now (``float8_utils.EPS``, 1e-12 in 0.18), read where it is loaded."""
    mod = sys.modules.get("torchao.float8.float8_utils")
    return float(getattr(mod, "EPS", AMAX_FLOOR)) if mod is not None else AMAX_FLOOR


def is_float8_linear(m: nn.Module) -> bool:
    """A torchao ``Float8Linear`` (by class name and its config: no torchao import)."""
    return type(m).__name__ == "Float8Linear" and hasattr(m, "config")


def _cast(cc: Any, pow2: bool) -> Cast:
    dt = getattr(cc, "target_dtype", torch.float8_e4m3fn)
    fmt = FP8_E5M2 if dt == torch.float8_e5m2 else FP8_E4M3
    gran = str(getattr(getattr(cc, "scaling_granularity", None), "value", "tensorwise"))
    enabled = str(getattr(getattr(cc, "scaling_type", None), "value", "dynamic")) != "disabled"
    return Cast(fmt, gran == "axiswise", pow2, enabled)


def casts_of(m: nn.Module) -> dict[str, Cast]:
    """The layer's cast of each operand (``OPERANDS``), read from its ``Float8LinearConfig``."""
    c: Any = m.config
    pow2 = bool(getattr(c, "round_scales_to_power_of_2", False))
    return {"input": _cast(c.cast_config_input, pow2), "weight": _cast(c.cast_config_weight, pow2),
            "grad_output": _cast(c.cast_config_grad_output, pow2)}


def recipe_of(model: nn.Module) -> dict[str, Any] | None:
    """The FP8 recipe of a converted model as plain data (the first Float8Linear's casts), None if none is converted."""
    layers = [n for n, m in model.named_modules() if is_float8_linear(m)]
    if not layers:
        return None
    first = dict(model.named_modules())[layers[0]]
    return {"layers": layers, "casts": {k: v.describe() for k, v in casts_of(first).items()},
            "emulate": bool(getattr(first.config, "emulate", False))}


class GemmObserver:
    """Hooks on every Float8Linear of ``model``; ``rows`` holds the per-GEMM statistics of each step ended."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = {name: m for name, m in model.named_modules() if is_float8_linear(m)}
        self.casts = {name: casts_of(m) for name, m in self.layers.items()}
        self.rows: list[GemmRow] = []
        self._handles: list[Any] = []
        self._queue: list[tuple[str, str, torch.Tensor]] = []
        self._step = 0

    def __bool__(self) -> bool:
        return bool(self.layers)

    def __enter__(self) -> GemmObserver:
        for name, m in self.layers.items():
            self._handles.append(m.register_forward_pre_hook(self._pre(name)))
            self._handles.append(m.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def begin(self, step: int) -> None:
        self._step = step
        self._queue.clear()

    def _add(self, name: str, operand: str, t: torch.Tensor) -> None:
        c = self.casts[name][operand]
        if not c.enabled or not t.is_floating_point() or t.numel() == 0:
            return
        self._queue.append((name, operand, operand_stats(t.detach(), c.fmt, rowwise=c.rowwise, round_pow2=c.pow2,
                                                                  floor=amax_floor())))

    def _pre(self, name: str) -> Any:
        def hook(m: nn.Module, args: tuple[Any, ...]) -> None:
            if not torch.is_grad_enabled() and not m.training:
                return
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is None:
                return
            with torch.no_grad():
                if torch.is_autocast_enabled("cuda") and x.is_cuda:  # Float8Linear casts its input as CUDA autocast would
                    x = x.to(torch.get_autocast_dtype("cuda"))
                self._add(name, "input", x)
                w = m.weight
                if isinstance(w, torch.Tensor):
                    self._add(name, "weight", w)
        return hook

    def _post(self, name: str) -> Any:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._grad(name))
        return hook

    def _grad(self, name: str) -> Any:
        def hook(g: torch.Tensor) -> None:
            with torch.no_grad():
                self._add(name, "grad_output", g)
        return hook

    def end_step(self) -> list[GemmRow]:
        """The step's rows: the queued vectors stacked and copied to the host once."""
        if not self._queue:
            return []
        mat = torch.stack([v.to(self._queue[0][2].device) for _, _, v in self._queue]).cpu().tolist()
        out = []
        for (name, operand, _), vals in zip(self._queue, mat, strict=True):
            c = self.casts[name][operand]
            out.append(GemmRow(self._step, name, operand, c.fmt.name, c.rowwise, dict(zip(OPERAND_FIELDS, vals, strict=True))))
        self._queue.clear()
        self.rows.extend(out)
        return out
