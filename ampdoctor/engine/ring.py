"""The ring's per-parameter figures, queued on the device into the step's one host copy.

``RingFigures(optimizer, params)(with_grad, norms)`` returns ``(names, values)``: each parameter's
gradient norm (the recipe takes them for the global norm anyway), the norm of the update its optimizer
state says it takes, and Adam's smallest ``exp_avg_sq``. The recipe stacks them after its own scalars
(``TrainStep.measure``), so they come back in the same copy; nothing here synchronises.

The update norm, read from the state as the step begins (before this step's ``optimizer.step``):

- Adam, AdamW and the like (``exp_avg`` and ``exp_avg_sq`` in the state): ``lr * sqrt(1 - b2^t) / (1 - b1^t)
  * |exp_avg / (sqrt(exp_avg_sq) + eps)|``, the step the state took last (decoupled weight decay left out);
- SGD with momentum: ``lr * |momentum_buffer|``; plain SGD: ``lr * |grad|``, this step's;
- any other optimizer: not kept (NaN).

Per-tensor work runs as ``torch._foreach_*`` calls over all parameters at once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ampdoctor.formats import Format
from ampdoctor.judge.history import DEFAULT_HORIZON, Forecast, Spike, forecast, robust_z, spiking_layers, story
from ampdoctor.judge.rules import forward_overflow_fixes
from ampdoctor.notify import say, warn_user
from ampdoctor.records import Finding, StepStats
from ampdoctor.report.words import forecast_message, history_lines, history_title
from ampdoctor.watch.ring import GRAD_NORM_KEY, UPDATE_KEY, VMIN_KEY, Ring


def _value(x: Any) -> float | None:
    if isinstance(x, (int, float)):
        return float(x)
    return None


class RingFigures:
    """Per-parameter ring figures for ``params`` (the recipe's, in its order)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, params: list[torch.nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.index = {id(p): j for j, p in enumerate(params)}
        self.group: dict[int, dict[str, Any]] = {}
        if optimizer is not None:
            for g in optimizer.param_groups:
                for p in g["params"]:
                    self.group[id(p)] = g
        self._names: dict[tuple[int, ...], tuple[str, ...]] = {}

    def __call__(self, with_grad: list[torch.nn.Parameter], norms: torch.Tensor) -> tuple[tuple[str, ...], torch.Tensor]:
        dev = norms.device
        js = [self.index.get(id(p), -1) for p in with_grad]
        parts = [norms.to(torch.float64)]
        names = [f"{GRAD_NORM_KEY}:{j}" for j in js]
        opt = self.optimizer
        if opt is not None:
            adam_m: list[torch.Tensor] = []
            adam_v: list[torch.Tensor] = []
            adam_j: list[int] = []
            factors: list[float] = []
            eps: list[float] = []
            sgd: list[tuple[int, float, torch.Tensor]] = []
            state = opt.state
            for p, j in zip(with_grad, js, strict=True):
                g = self.group.get(id(p))
                st = state.get(p) if g is not None else None
                if g is None:
                    continue
                lr = _value(g.get("lr"))
                if lr is None:
                    continue
                if st and "exp_avg" in st and "exp_avg_sq" in st:
                    t = st.get("step")
                    k = float(t) if isinstance(t, (int, float)) or (isinstance(t, torch.Tensor) and t.device.type == "cpu") else None
                    b = g.get("betas", (0.9, 0.999))
                    f = lr
                    if k and k > 0:
                        f = lr * (1.0 - float(b[1]) ** k) ** 0.5 / (1.0 - float(b[0]) ** k)
                    adam_m.append(st["exp_avg"])
                    adam_v.append(st["exp_avg_sq"])
                    adam_j.append(j)
                    factors.append(f)
                    eps.append(float(g.get("eps", 1e-8)))
                elif "momentum" in g:
                    buf = st.get("momentum_buffer") if st else None
                    if isinstance(buf, torch.Tensor):
                        sgd.append((j, lr, buf))
                    elif not g.get("momentum"):
                        sgd.append((j, lr, p.grad if p.grad is not None else torch.zeros(())))
            if adam_m:
                denom = torch._foreach_sqrt(adam_v)
                torch._foreach_add_(denom, eps)
                u = torch._foreach_div(adam_m, denom)
                un = torch.stack([n.to(dev, torch.float64) for n in torch._foreach_norm(u)])
                parts.append(un * torch.tensor(factors, dtype=torch.float64, device=dev))
                names += [f"{UPDATE_KEY}:{j}" for j in adam_j]
                try:
                    vmin = torch._foreach_norm(adam_v, float("-inf"))
                except (RuntimeError, NotImplementedError):  # a device without the -inf foreach norm
                    vmin = [torch.linalg.vector_norm(v, float("-inf")) for v in adam_v]
                parts.append(torch.stack([n.to(dev, torch.float64) for n in vmin]))
                names += [f"{VMIN_KEY}:{j}" for j in adam_j]
            if sgd:
                sn = torch._foreach_norm([b.float() for _, _, b in sgd])
                parts.append(torch.stack([n.to(dev, torch.float64) for n in sn])
                             * torch.tensor([lr for _, lr, _ in sgd], dtype=torch.float64, device=dev))
                names += [f"{UPDATE_KEY}:{j}" for j, _, _ in sgd]
        return tuple(names), torch.cat(parts)


class ForecastWarning(UserWarning):
    """A layer is on course to leave FP16's range (``Monitor(forecast_horizon=...)``)."""


SPIKE_WINDOW = 100


class Lookback:
    """The Monitor's ring, its forecast and its spike trigger: ``push`` after each step.

    ``horizon``: warn once when a layer is on course to pass the format's max within this many steps
    (None: no forecast). ``spike_sigmas``: a loss or gradient norm this many robust standard deviations
    above the median of the ``spike_window`` steps before it is a failure (None: off)."""

    def __init__(self, steps: int, modules: list[str], params: list[str], fmt: Format, *, horizon: int | None,
                 spike_sigmas: float | None, spike_window: int, quiet: bool, speaks: bool, device: str) -> None:
        self.ring = Ring(steps, modules, fmt)
        self.ring.set_params(params)
        self.fmt = fmt
        self.horizon = horizon
        self.spike_sigmas = spike_sigmas
        self.spike_window = spike_window
        self.quiet = quiet
        self.speaks = speaks
        """This rank says the forecast (one rank under torch.distributed)."""
        self.device = device
        self.warned: Forecast | None = None
        """The forecast the monitor warned of (once a run)."""
        self.last_spike: Spike | None = None
        """The run's first spike (with ``spike_sigmas``)."""

    def push(self, step: int, *, loss: float, grad_norm: float, scale: float | None, skipped: bool, lr: float | None,
             stats: StepStats | None) -> Spike | None:
        """Keep the step; forecast on recorded steps; return a spike when the trigger is on and this step is one."""
        # (the run's first spike is its failure; the steps after it are its consequence)
        spike = (self._spike(step, loss, grad_norm, skipped) if self.spike_sigmas is not None and self.last_spike is None
                 else None)
        self.ring.push(step, loss=loss, grad_norm=grad_norm, scale=scale, skipped=skipped, lr=lr, stats=stats)
        if stats is not None and self.horizon is not None and self.warned is None:
            fcs = self.forecast()
            if fcs:
                self._warn(fcs)
        if spike is not None:
            self.last_spike = spike = self._with_layers(spike)
        return spike

    def forecast(self) -> list[Forecast]:
        """The layers on course to leave the format's range within the horizon, soonest first (now)."""
        steps, a = self.ring.layer_series("absmax")
        _, bad = self.ring.layer_series("nonfinite_frac")
        return forecast(steps, a, bad, self.ring.names, self.fmt.max, self.horizon or DEFAULT_HORIZON)

    def _warn(self, fcs: list[Forecast]) -> None:
        fc = fcs[0]
        self.warned = fc
        if not self.speaks:
            return
        msg = forecast_message(fc, forward_overflow_fixes(fc.layer, self.device), more=len(fcs) - 1)
        say(msg, quiet=self.quiet, warned=not self.quiet)
        if not self.quiet:
            warn_user(msg.split("\n")[0], ForecastWarning)

    def _spike(self, step: int, loss: float, grad_norm: float, skipped: bool) -> Spike | None:
        """A finite loss or gradient norm far above the window of applied steps before it (skips are GradScaler's)."""
        if skipped or self.ring.count < 16:
            return None
        _, ls = self.ring.step_series("loss", self.spike_window)
        _, gs = self.ring.step_series("grad_norm", self.spike_window)
        _, sk = self.ring.step_series("skipped", self.spike_window)
        keep = sk == 0.0
        for what, value, hist in (("loss", loss, ls[keep]), ("grad_norm", grad_norm, gs[keep])):
            if not math.isfinite(value) or np.isfinite(hist).sum() < 16:
                continue
            z = robust_z(value, hist)
            assert self.spike_sigmas is not None
            if z > self.spike_sigmas:
                return Spike(step, what, float(value), float(np.nanmedian(hist)), float(z))
        return None

    def _with_layers(self, sp: Spike) -> Spike:
        """The layers whose update norms spiked first (gradient norms where no update norm is kept), in the
        steps since the loss or norm last sat at its median."""
        assert self.spike_sigmas is not None
        layers: list[dict[str, Any]] = []
        for fig in ("update_norm", "grad_norm"):
            steps, vals = self.ring.layer_series(fig, self.spike_window + 8)
            if not len(steps) or not np.isfinite(vals).any():
                continue
            since = max(sp.step - 8, int(steps[0]) + 1)
            layers = [dict(h, figure=fig) for h in
                      spiking_layers(steps, vals, self.ring.names, self.spike_sigmas, since, self.spike_window)]
            if layers:
                break
        return Spike(sp.step, sp.what, sp.value, sp.median, sp.z, layers)


def _finite(x: Any) -> Any:
    """JSON-safe figures: NaN and the infinities as the report's strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def history_finding(ring: tuple[Any, Any], fail_step: int, culprit: str | None) -> Finding | None:
    """The story of the steps before a captured failure, as one finding (code ``history``, severity info): its
    evidence holds the figures (``judge.history.story``), its title and fix the words (``report.words``)."""
    steps_df, layers_df = ring
    told = story(steps_df, layers_df, fail_step, culprit)
    if told is None:
        return None
    title = history_title(told)
    lines = history_lines(told)
    return Finding("history", "info", title=title, module=told.get("layer"), step=told.get("crossed_step"),
                   evidence=_finite({**told, "lines": lines}))


__all__ = ["ForecastWarning", "Lookback", "RingFigures", "history_finding"]
