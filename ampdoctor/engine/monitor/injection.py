"""Fault injection: an Inf written into a gradient (``inject_inf_at``), targets multiplied (``inject_spike_at``).

For tests and demonstrations of the monitor itself: the step's record says what was injected (``injected``),
and the failure judge knows an injected fault is no loss scale's.
"""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor.engine.monitor.config import MonitorConfig
from ampdoctor.errors import UsageError
from ampdoctor.watch.model_view import local, named_parameters, unwrap


class Injection:
    """The steps to inject at, and what was injected at this one."""

    def __init__(self, cfg: MonitorConfig, model: nn.Module) -> None:
        named = unwrap(model)  # a compiled model: names without its ``_orig_mod.`` prefix
        if cfg.inject_param is not None and cfg.inject_param not in {n for n, _ in named_parameters(named)}:
            raise UsageError(f"inject_param {cfg.inject_param!r} is not a parameter of the model")
        self.model = model
        self.inf_at: set[int] = set(cfg.inject_inf_at)
        self.spike_at: set[int] = set(cfg.inject_spike_at)
        self.param = cfg.inject_param
        self.factor = cfg.spike_factor
        self.spiked = False
        """``spike`` multiplied this step's targets."""

    def spike(self, target: torch.Tensor, step: int) -> torch.Tensor:
        """``target * spike_factor`` at the steps in ``inject_spike_at``, else ``target`` unchanged."""
        if step in self.spike_at:
            self.spiked = True
            return target * self.factor
        return target

    def label(self, injected: str) -> str:
        """The record's ``injected``: the recipe's Inf, and 'spike' if this step's targets were multiplied."""
        if self.spiked:
            self.spiked = False
            return (injected + ";" if injected else "") + "spike"
        return injected

    def inf(self, step: int, params: list[nn.Parameter], names: dict[int, str]) -> str:
        """Write an Inf into a gradient at the steps in ``inject_inf_at`` (before ``unscale_``): 'inf:<param>', or ''."""
        if step not in self.inf_at:
            return ""
        if self.param is not None:
            p = dict(named_parameters(unwrap(self.model)))[self.param]
            if p.grad is None:
                raise UsageError(f"cannot inject into {self.param}: it has no gradient at step {step}")
            name = self.param
        else:
            cands = [q for q in params if q.grad is not None]
            if not cands:
                raise UsageError(f"cannot inject an Inf at step {step}: no parameter has a gradient")
            p, name = cands[0], names[id(cands[0])]
        assert p.grad is not None
        with torch.no_grad():
            g = local(p.grad)
            if g.numel() == 0:  # this rank holds an empty slice of it
                return ""
            if g.dim() == 0:
                g.fill_(float("inf"))
            else:
                g[(0,) * g.dim()] = float("inf")
        return f"inf:{name}"


__all__ = ["Injection"]
