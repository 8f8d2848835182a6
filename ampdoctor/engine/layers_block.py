"""``ampdoctor layers --dtype mxfp8,nvfp4``: per layer, what a block-scaled format would do to its tensors.

FP32 reference steps (the one step recipe, as ``engine.layers`` runs them) with hooks on every module and
parameter; each module's output, the gradient at that output, each parameter and its gradient are reduced on
their device by ``scaled.block_stats`` (the share of blocks whose dynamic range exceeds the format, of elements
flushed to 0 and saturated), and a step's rows are copied to the host once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch
from torch import nn

from ampdoctor.engine.driver import Driver
from ampdoctor.engine.forward import default_optimizer
from ampdoctor.engine.step import TrainStep
from ampdoctor.errors import SpecError
from ampdoctor.input.batches import Batches
from ampdoctor.ladder import FP32
from ampdoctor.records import MODEL
from ampdoctor.scaled import BLOCK_FIELDS, BlockFormat, block_stats

BLOCK_COLUMNS = ["module", "kind", "param", "dtype", "step", "numel", "blocks", "exceeding_frac", "flushed_frac",
                 "saturated_frac", "order"]
"""One row per (module, kind, param, block format, step); shares of blocks (``exceeding_frac``) and elements."""


class _BlockHooks:
    """Forward hooks on every module (outputs, and a hook on each output for its gradient); parameters read at
    the step's start and their gradients after backward. Queues device vectors; ``end_step`` copies them once."""

    def __init__(self, model: nn.Module, fmts: Sequence[BlockFormat], what: tuple[str, ...]) -> None:
        self.model, self.fmts, self.what = model, list(fmts), what
        self.queue: list[tuple[str, str, str, str, torch.Tensor]] = []
        self.order: dict[str, int] = {}
        self.handles: list[Any] = []

    def _add(self, module: str, kind: str, param: str, t: torch.Tensor) -> None:
        if not t.is_floating_point() or t.numel() == 0:
            return
        self.order.setdefault(module, len(self.order))
        for f in self.fmts:
            self.queue.append((module, kind, param, f.name, block_stats(t.detach(), f)))

    def __enter__(self) -> _BlockHooks:
        for name, m in self.model.named_modules():
            if m is self.model:
                continue
            self.handles.append(m.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _post(self, name: str) -> Callable[..., None]:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            outs = [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)] \
                if isinstance(out, (tuple, list)) else []
            for j, o in enumerate(outs):
                label = "output" if len(outs) == 1 else f"output[{j}]"
                if "activations" in self.what:
                    self._add(name, "act", label, o)
                if "grads" in self.what and o.requires_grad:
                    o.register_hook(self._grad(name, label))
        return hook

    def _grad(self, name: str, label: str) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            self._add(name, "act_grad", label, g)
        return hook

    def params(self, kind: str) -> None:
        for full, p in self.model.named_parameters():
            mod, _, pname = full.rpartition(".")
            t = p if kind == "param" else p.grad
            if t is not None:
                self._add(mod or MODEL, kind, pname, t)

    def end_step(self, step: int) -> list[dict[str, Any]]:
        if not self.queue:
            return []
        mat = torch.stack([v for *_, v in self.queue]).cpu().tolist()
        rows = []
        for (module, kind, param, fmt, _), vals in zip(self.queue, mat, strict=True):
            d = dict(zip(BLOCK_FIELDS, vals, strict=True))
            n, b = max(d["numel"], 1.0), max(d["blocks"], 1.0)
            rows.append({"module": module, "kind": kind, "param": param, "dtype": fmt, "step": step,
                         "numel": int(d["numel"]), "blocks": int(d["blocks"]), "exceeding_frac": d["blocks_exceeding"] / b,
                         "flushed_frac": d["flushed"] / n, "saturated_frac": d["saturated"] / n,
                         "order": self.order.get(module, len(self.order))})
        self.queue.clear()
        return rows


def block_layer_stats(model: nn.Module, batches: Batches, fmts: Sequence[BlockFormat], steps: int = 3,
                      what: tuple[str, ...] = ("activations", "grads", "weights"), loss_fn: Callable[..., Any] | None = None,
                      optimizer: torch.optim.Optimizer | None = None, device: torch.device | None = None, seed: int = 0,
                      max_norm: float | None = None) -> pd.DataFrame:
    """Block-scaled statistics of ``model``'s tensors over ``steps`` FP32 reference steps (``BLOCK_COLUMNS``).
    The model and the optimizer are restored after the steps, as ``engine.layers.layer_stats`` does."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    opt = optimizer if optimizer is not None else default_optimizer(model.parameters())
    dev = device or next(model.parameters()).device
    recipe = TrainStep(model, opt, None, precision=FP32, skip_nonfinite=False, max_norm=max_norm)
    driver = Driver(recipe, loss_fn, dev)
    hooks = _BlockHooks(model, fmts, what)
    rows: list[dict[str, Any]] = []
    torch.manual_seed(seed)
    try:
        with hooks:
            model.train()
            for step in range(steps):
                driver.begin(step)
                if "weights" in what:
                    hooks.params("param")
                try:
                    driver.accumulate(batches[step])
                except Exception as e:  # user code: say where
                    raise SpecError(f"the FP32 reference step {step} raised {type(e).__name__}: {str(e).strip()[:200]}") from e
                if "grads" in what:
                    hooks.params("param_grad")
                m, _ = driver.measure()
                driver.apply(m)
                rows.extend(hooks.end_step(step))
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(opt_state)
    return pd.DataFrame.from_records(rows, columns=BLOCK_COLUMNS)


def worst(df: pd.DataFrame, fmt: str) -> pd.DataFrame:
    """Per (module, kind, param): the largest shares over the steps, most blocks exceeding first."""
    d = df[df["dtype"] == fmt]
    if d.empty:
        return d
    g = d.groupby(["module", "kind", "param"], sort=False).agg(
        numel=("numel", "max"), blocks=("blocks", "max"), exceeding_frac=("exceeding_frac", "max"),
        flushed_frac=("flushed_frac", "max"), saturated_frac=("saturated_frac", "max"), order=("order", "min")).reset_index()
    return g.sort_values(["exceeding_frac", "flushed_frac", "order"], ascending=[False, False, True], kind="stable")
