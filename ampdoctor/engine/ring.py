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

Adam's figures are a few flat passes, each over pieces of the state of at most ``CHUNK`` elements (its
temporaries: three float32 copies of a piece, whatever the model's size), reduced per tensor with
``segment_reduce``; SGD's are one ``torch._foreach_norm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ampdoctor.engine.growth import applied
from ampdoctor.formats import Format
from ampdoctor.judge.history import DEFAULT_HORIZON, Forecast, Spike, forecast, robust_z, spiking_layers, story
from ampdoctor.notify import alert
from ampdoctor.records import Finding, StepStats
from ampdoctor.report.alerts import forecast_alert, history_words
from ampdoctor.watch.fused import fused_adam
from ampdoctor.watch.ring import Ring


def _value(x: Any) -> float | None:
    if isinstance(x, (int, float)):
        return float(x)
    return None


CHUNK = 1 << 22
"""Elements per piece of the Adam figures' flat pass: what its temporaries hold at most (three float32 copies)."""


def _pieces(tensors: list[torch.Tensor], groups: list[int]) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """Chunks of at most ``CHUNK`` elements, one group each: ``(group, [(tensor index, start, stop), ...])``; a
    tensor larger than a chunk is split across several."""
    out: list[tuple[int, list[tuple[int, int, int]]]] = []
    cur: list[tuple[int, int, int]] = []
    size = 0
    cur_g = None
    for i, (t, g) in enumerate(zip(tensors, groups, strict=True)):
        n = t.numel()
        start = 0
        while start < n:
            if cur and (size >= CHUNK or g != cur_g):
                out.append((cur_g, cur))  # type: ignore[arg-type]
                cur, size = [], 0
            cur_g = g
            stop = min(n, start + CHUNK - size)
            cur.append((i, start, stop))
            size += stop - start
            start = stop
    if cur:
        out.append((cur_g, cur))  # type: ignore[arg-type]
    return out


Chunk = tuple[int, list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]
"""(group, views of exp_avg, views of exp_avg_sq, lengths, owner tensor index): one flat pass."""


def adam_chunks(m: list[torch.Tensor], v: list[torch.Tensor], groups: list[int], dev: torch.device) -> list[Chunk]:
    """The flat passes over Adam's state: views into the state tensors (the optimizer updates them in place)."""
    out = []
    for g, parts in _pieces(v, groups):
        out.append((g, [m[i].reshape(-1)[a:b] for i, a, b in parts], [v[i].reshape(-1)[a:b] for i, a, b in parts],
                    torch.tensor([b - a for _, a, b in parts], device=v[parts[0][0]].device),
                    torch.tensor([i for i, _, _ in parts], device=dev)))
    return out


def adam_figures(n: int, chunks: list[Chunk], eps: list[float], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor: |m / (sqrt(v) + eps)| and min(v), in a few flat passes (``chunks``), on the device."""
    sq = torch.zeros(n, dtype=torch.float64, device=dev)
    lo = torch.full((n,), math.inf, dtype=torch.float64, device=dev)
    for g, ms, vs, lengths, owner in chunks:
        mm = torch.cat(ms).float()
        vv = torch.cat(vs).float()
        u = vv.sqrt().add_(eps[g])
        torch.div(mm, u, out=u)
        u.mul_(u)
        sums = torch.segment_reduce(u, "sum", lengths=lengths).to(dev, torch.float64)
        mins = torch.segment_reduce(vv, "min", lengths=lengths).to(dev, torch.float64)
        sq.index_add_(0, owner, sums)
        lo.scatter_reduce_(0, owner, mins, "amin")
    return sq.sqrt(), lo


_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False
"""No indices (one array, so that the ring's per-layout cache sees the same object every step)."""
_NO_FACTOR = np.zeros(0)
_NO_FACTOR.flags.writeable = False


@dataclass
class _Plan:
    """What the figures read, for one set of parameters with gradients (rebuilt when that set or the state changes)."""

    key: tuple[int, int, int]
    grad_j: np.ndarray
    adam_m: list[torch.Tensor]
    adam_v: list[torch.Tensor]
    adam_j: np.ndarray
    adam_group: np.ndarray
    """Per Adam tensor, its group's index (its bias correction and lr)."""
    adam_eps: list[float]
    """Per group, its eps."""
    tensor_eps: list[float]
    """Per Adam tensor, its group's eps."""
    chunks: list[Chunk]
    sgd: list[torch.Tensor]
    sgd_j: np.ndarray
    sgd_group: np.ndarray
    plain_pos: np.ndarray
    """Plain SGD (no momentum): positions among the parameters with gradients (the update is lr x the gradient)."""
    plain_j: np.ndarray
    plain_group: np.ndarray
    plain_dev: torch.Tensor | None
    """``plain_pos`` on the device (made once)."""
    first: dict[int, torch.nn.Parameter]
    """Per group, its first parameter with Adam state (its step count gives the group's bias correction)."""
    probe: tuple[torch.nn.Parameter, torch.Tensor] | None
    """A parameter and its ``exp_avg``: a state loaded since (new tensors) makes a new plan."""
    joined: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)
    """The update figures' indices, joined once per combination of parts (the same array every step)."""


class RingFigures:
    """Per-parameter ring figures for ``params`` (the recipe's, in its order).

    Called with the parameters that have a gradient and their norms (on the device), it returns
    ``(layout, values)``: ``layout`` is ``(grad_j, update_j, vmin_j, update_factor)``, the indices into ``params``
    of each part of ``values`` (gradient norms, update norms before their learning rate and bias correction,
    Adam's smallest ``exp_avg_sq``) and the host factors of the update norms; the recipe queues ``values``
    whole into the step's host copy (``Hooks.add_tail``)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, params: list[torch.nn.Parameter], every: int = 1) -> None:
        self.optimizer = optimizer if isinstance(getattr(optimizer, "state", None), dict) else None
        """The optimizer whose state is read; None for one without a per-parameter ``state`` dict (an engine's
        view of its parameters, DeepSpeed's): its update figures are then not kept."""
        self.index = {id(p): j for j, p in enumerate(params)}
        self._plan: _Plan | None = None
        self.every = every
        """The optimizer's figures (update norms, Adam's smallest exp_avg_sq: a pass over its state) on every
        this-many-th call; the gradient norms on every call."""
        self._calls = 0

    def _make_plan(self, with_grad: list[torch.nn.Parameter], key: tuple[int, int, int], norms_dev: torch.device) -> _Plan:
        opt = self.optimizer
        js = np.array([self.index.get(id(p), -1) for p in with_grad], dtype=np.int64)
        am: list[torch.Tensor] = []
        av: list[torch.Tensor] = []
        aj: list[int] = []
        ag: list[int] = []
        ae: list[float] = []
        sg: list[torch.Tensor] = []
        sj: list[int] = []
        sgi: list[int] = []
        pp: list[int] = []
        pj: list[int] = []
        pg: list[int] = []
        first: dict[int, torch.nn.Parameter] = {}
        probe = None
        if opt is not None:
            group_of = {id(p): (gi, g) for gi, g in enumerate(opt.param_groups) for p in g["params"]}
            for pos, (p, j) in enumerate(zip(with_grad, js.tolist(), strict=True)):
                gg = group_of.get(id(p))
                if gg is None:
                    continue
                gi, g = gg
                st = opt.state.get(p)
                if st and isinstance(st.get("exp_avg"), torch.Tensor) and isinstance(st.get("exp_avg_sq"), torch.Tensor):
                    am.append(st["exp_avg"])
                    av.append(st["exp_avg_sq"])
                    first.setdefault(gi, p)
                    probe = probe or (p, st["exp_avg"])
                    aj.append(j)
                    ag.append(gi)
                elif "momentum" in g:
                    buf = st.get("momentum_buffer") if st else None
                    if isinstance(buf, torch.Tensor):
                        sg.append(buf)
                        sj.append(j)
                        sgi.append(gi)
                    elif not g.get("momentum"):  # plain SGD: this step's update is lr x its gradient
                        pp.append(pos)
                        pj.append(j)
                        pg.append(gi)
        if opt is not None:
            ae = [float(g.get("eps", 1e-8)) for g in opt.param_groups]
        return _Plan(key, js, am, av, np.array(aj, dtype=np.int64), np.array(ag, dtype=np.int64), ae, [ae[g] for g in ag],
                     adam_chunks(am, av, ag, norms_dev), sg,
                     np.array(sj, dtype=np.int64), np.array(sgi, dtype=np.int64),
                     np.array(pp, dtype=np.int64), np.array(pj, dtype=np.int64), np.array(pg, dtype=np.int64),
                     torch.tensor(pp, dtype=torch.int64, device=norms_dev) if pp else None, first, probe)

    def _factors(self, plan: _Plan) -> tuple[np.ndarray, np.ndarray]:
        """Per group: Adam's lr x bias correction (from its first Adam parameter's step count), and the lr."""
        opt = self.optimizer
        assert opt is not None
        groups = opt.param_groups
        adam = np.full(len(groups), np.nan)
        lrs = np.full(len(groups), np.nan)
        for gi, g in enumerate(groups):
            lr = _value(g.get("lr"))
            if lr is None:
                continue
            lrs[gi] = lr
            p = plan.first.get(gi)
            if p is not None:
                st = opt.state.get(p) or {}
                t = st.get("step")
                k = float(t) if isinstance(t, (int, float)) or (isinstance(t, torch.Tensor) and t.device.type == "cpu") else None
                b = g.get("betas", (0.9, 0.999))
                adam[gi] = lr * (1.0 - float(b[1]) ** k) ** 0.5 / (1.0 - float(b[0]) ** k) if k else lr
        return adam, lrs

    def __call__(self, with_grad: list[torch.nn.Parameter], norms: torch.Tensor) -> tuple[Any, torch.Tensor]:
        dev = norms.device
        opt = self.optimizer
        key = (len(with_grad), id(with_grad[0]) if with_grad else 0, len(opt.state) if opt is not None else 0)
        plan = self._plan
        if plan is None or plan.key != key or (plan.probe is not None and opt is not None and
                                                (opt.state.get(plan.probe[0]) or {}).get("exp_avg") is not plan.probe[1]):
            plan = self._plan = self._make_plan(with_grad, key, dev)
        parts = [norms.reshape(-1).to(torch.float64)]
        upd_j: list[np.ndarray] = []
        factor: list[np.ndarray] = []
        vmin_j = plan.adam_j
        self._calls += 1
        if opt is not None and (plan.adam_m or plan.sgd or len(plan.plain_j)) and (self._calls - 1) % self.every == 0:
            # the learning rates and bias corrections are host numbers: they multiply the norms on the host, after
            # the copy (a host tensor sent to the device would be a copy that waits for the stream)
            adam_f, lrs = self._factors(plan)
            vmin = None
            if plan.adam_m:
                both = fused_adam(plan.adam_m, plan.adam_v, plan.tensor_eps) if dev.type == "cpu" else None
                if both is not None:  # one C++ pass over each state tensor (watch.fused)
                    k = len(plan.adam_m)
                    un, vmin = both[:k], both[k:]
                else:
                    un, vmin = adam_figures(len(plan.adam_m), plan.chunks, plan.adam_eps, dev)
                parts.append(un)
                upd_j.append(plan.adam_j)
                factor.append(adam_f[plan.adam_group])
            if plan.sgd:
                parts.append(torch.stack([n.to(dev) for n in torch._foreach_norm(plan.sgd)]).to(torch.float64))
                upd_j.append(plan.sgd_j)
                factor.append(lrs[plan.sgd_group])
            if plan.plain_dev is not None:
                parts.append(norms.reshape(-1).to(torch.float64)[plan.plain_dev])
                upd_j.append(plan.plain_j)
                factor.append(lrs[plan.plain_group])
            if vmin is not None:
                parts.append(vmin)
        else:
            vmin_j = _NONE
        ids = tuple(id(j) for j in upd_j)
        joined = plan.joined.get(ids)
        if joined is None:
            joined = plan.joined[ids] = np.concatenate(upd_j) if upd_j else np.zeros(0, dtype=np.int64)
        layout = (plan.grad_j, joined, vmin_j, np.concatenate(factor) if factor else _NO_FACTOR)
        return layout, torch.cat(parts) if len(parts) > 1 else parts[0]


class ForecastWarning(UserWarning):
    """A layer is on course to leave FP16's range (``Monitor(forecast_horizon=...)``)."""


SPIKE_WINDOW = 100
OPTIMIZER_EVERY = 16
"""Without the spike trigger, the optimizer's figures are read on every this-many-th recorded step (a pass over
its state costs about as much as the statistics of the gradients); with it, on every recorded step."""
FORECAST_EVERY = 16
"""The forecast is judged on every this-many-th recorded step (a warning at most that many steps late, against
a horizon of a thousand)."""


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
        self._recorded = 0
        """The run's first spike (with ``spike_sigmas``)."""

    def push(self, step: int, *, loss: float, grad_norm: float, scale: float | None, skipped: bool, lr: float | None,
             stats: StepStats | None) -> Spike | None:
        """Keep the step; forecast on recorded steps; return a spike when the trigger is on and this step is one."""
        # (the run's first spike is its failure; the steps after it are its consequence)
        spike = (self._spike(step, loss, grad_norm, skipped) if self.spike_sigmas is not None and self.last_spike is None
                 else None)
        self.ring.push(step, loss=loss, grad_norm=grad_norm, scale=scale, skipped=skipped, lr=lr, stats=stats)
        if stats is not None:
            self._recorded += 1
        if (stats is not None and self.horizon is not None and self.warned is None and not skipped
                and self._recorded % FORECAST_EVERY == 0):  # (no warning while the updates are skipped: a failure's)
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
        keep = applied(self.ring, steps)  # a trend is fitted over steps that applied an update (growth.applied)
        return forecast(steps[keep], a[keep], bad[keep], self.ring.names, self.fmt.max, self.horizon or DEFAULT_HORIZON)

    def _warn(self, fcs: list[Forecast]) -> None:
        self.warned = fcs[0]
        if self.speaks:
            alert(forecast_alert(fcs, self.device), ForecastWarning, quiet=self.quiet)

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


def history_finding(ring: tuple[Any, Any], fail_step: int, culprit: str | None, cause: str = "") -> Finding | None:
    """The story of the steps before a captured failure, as one finding (code ``history``, severity info): its
    evidence holds the figures (``judge.history.story``), its title and lines the words (``report.alerts.history_words``).
    A ``data`` verdict's story tells no overflow: the non-finite values came with the batch."""
    steps_df, layers_df = ring
    told = story(steps_df, layers_df, fail_step, culprit, overflow=cause != "data")
    if told is None:
        return None
    title, lines = history_words(told)
    return Finding("history", "info", title=title, module=told.get("layer"), step=told.get("crossed_step"),
                   evidence=_finite({**told, "lines": lines}))


__all__ = ["ForecastWarning", "Lookback", "RingFigures", "history_finding"]
