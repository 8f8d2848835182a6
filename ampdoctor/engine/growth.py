"""The forecast where growth shows first: the ops inside modules, the gradients, the loss (issue 44).

The lookback ring's forecast (``engine.ring.Lookback``) reads each module's output. Growth toward FP16's max often
shows elsewhere first, where no module output sees it:

- **an op inside a module**: the raw ``q @ k^T`` of an attention module passes 65504 while the module returns a
  softmax-weighted mean of ``v`` (``watch.opwatch``: the largest |x| of each op in the format's dtype);
- **an activation gradient**: the gradient at a module's output, computed in FP16 where that output is FP16
  (a sum-reduced loss: the gradient at the output is ``2 (out - y)``, and grows with the targets);
- **a parameter gradient**: a weight gradient is a reduction over the batch and the sequence, computed in FP16
  where the module runs in FP16, so it grows with the sequence length of a warm-up;
- **the loss**, where the loss itself is a tensor in the format's dtype.

Each is a series per culprit, over every ``SAMPLE_EVERY``-th recorded step (steps that applied an update), judged by the same rule as a module's output
(``judge.history.forecast``: Theil-Sen slope, Mann-Kendall z, the format's max within the horizon). The gradients
are unscaled first: the gradient at a module's output is recorded as the backward carries it (times the loss
scale), so it is divided by the scale the step used; GradScaler's failure is the unscaled gradient's (a skip at a
scale of 1 or less: the gradients themselves leave FP16). The parameter gradients are recorded unscaled. A culprit is
warned of once (``ForecastWarning``, by one rank), with its name and kind.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np
import torch
from torch import nn

from ampdoctor.formats import Format
from ampdoctor.judge.history import DEFAULT_HORIZON, MIN_POINTS, WINDOW, Forecast, forecast
from ampdoctor.notify import alert
from ampdoctor.records import MODEL, Col, StepStats
from ampdoctor.report.alerts import growth_alert
from ampdoctor.watch.calls import uses_compile
from ampdoctor.watch.model_view import unwrap
from ampdoctor.watch.opwatch import OpWatch, op_figures

KINDS = ("op", "grad", "pgrad", "loss")
"""What a culprit is: an op inside a module, the gradient at a module's output, a parameter's gradient, the loss."""

MAX_SERIES = 2048
"""Culprits kept at most (a model of thousands of modules: the first seen)."""

SAMPLE_EVERY = 2
"""The ops and gradients are read on every this-many-th recorded step (the op watch's mode, a Python call per op, and
the figures of a step cost about as much as the step's statistics on a model of many small modules: half of it)."""
JUDGE_EVERY = 16 // SAMPLE_EVERY
"""The culprits are judged on every this-many-th sampled step (every 16th recorded step, as the module forecast)."""
G_WINDOW = WINDOW // SAMPLE_EVERY
G_MIN_POINTS = MIN_POINTS // SAMPLE_EVERY
"""The fit's window and least points, in sampled steps: the module forecast's span of recorded steps."""


def _calls(st: StepStats) -> Any:
    """(module name, output tensor ids) of each call (the C++ recorder's flat calls, or ``Call`` objects)."""
    if st.flat_calls:
        for names, mods, bounds, tids in st.flat_calls:
            for k, m in enumerate(mods):
                yield names[m], tids[bounds[2 * k + 1]: bounds[2 * k + 2]]
    for c in st.__dict__.get("_calls") or []:
        yield c.module, c.outputs


def grad_figures(st: StepStats) -> tuple[dict[int, float], dict[str, float]]:
    """(tensor id -> largest finite |gradient| at it, parameter -> largest finite |gradient|) of a recorded step,
    read from its row matrix without making the row dicts (else from them). A row with a NaN or an infinity gives
    ``inf``: that gradient has left the range already."""
    rm = st.row_matrix
    grads: dict[int, float] = {}
    pgrads: dict[str, float] = {}
    if rm is not None:
        keys, m = rm
        bad = m[:, Col.POSINF] + m[:, Col.NEGINF] + m[:, Col.NAN] if len(m) else m
        for i, (kind, ident) in enumerate(keys):
            if kind == "grad":
                grads[ident] = math.inf if bad[i] > 0 else float(m[i, Col.ABSMAX])
            elif kind == "pgrad":
                pgrads[ident] = math.inf if bad[i] > 0 else float(m[i, Col.ABSMAX])
        return grads, pgrads
    for tid, r in st.grad.items():
        grads[tid] = math.inf if r[Col.POSINF] + r[Col.NEGINF] + r[Col.NAN] > 0 else float(r[Col.ABSMAX])
    for name, r in st.pgrad.items():
        pgrads[name] = math.inf if r[Col.POSINF] + r[Col.NEGINF] + r[Col.NAN] > 0 else float(r[Col.ABSMAX])
    return grads, pgrads


def applied(ring: Any, steps: np.ndarray) -> np.ndarray:
    """Which of ``steps`` (recorded steps the ring keeps) applied an update: a forecast fits those only. A skipped
    step changed no weight, so its figures are the batch's noise, and after a failure every step may be skipped."""
    all_steps, skipped = ring.step_series("skipped")
    ok = all_steps[skipped == 0.0]
    return np.isin(steps, ok)


def _owner(param: str, modules: set[str]) -> str:
    name = param
    while "." in name:
        name = name.rsplit(".", 1)[0]
        if name in modules:
            return name
    return MODEL


class Growth:
    """The culprits' series and their forecast (``push`` after each step the hooks recorded)."""

    def __init__(self, fmt: Format, dtype: torch.dtype, ops: OpWatch | None, *, horizon: int, quiet: bool,
                 speaks: bool, device: str, params_reduced: set[str]) -> None:  # noqa: PLR0913
        self.fmt, self.dtype, self.ops = fmt, dtype, ops
        self.horizon, self.quiet, self.speaks, self.device = horizon, quiet, speaks, device
        self.params_reduced = params_reduced
        """Parameters held in the format's dtype themselves (a model in ``.half()``)."""
        self.steps: deque[int] = deque(maxlen=G_WINDOW)
        """The recorded steps that applied an update (a skipped step's figures are not kept: ``applied``)."""
        self.series: dict[str, tuple[str, deque[float]]] = {}
        """culprit -> (kind, its figures over the kept steps; NaN where it was not seen)."""
        self.loss_dtype: torch.dtype | None = None
        self.warned: dict[str, Forecast] = {}
        """The culprits warned of (once each), and the forecast said."""
        self._recorded = 0
        self._seen = 0
        """Recorded steps seen (the sampled ones: every ``SAMPLE_EVERY``-th)."""
        self.category: type[Warning] = UserWarning
        """The warning's class (the Monitor's ``ForecastWarning``)."""

    def note_loss(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            self.loss_dtype = loss.dtype

    def push(self, step: int, stats: StepStats | None, loss: float, scale: float | None, skipped: bool = False) -> None:
        if self.ops is not None:
            self.ops.end_step()
        if stats is None:
            return
        sampled = self._seen % SAMPLE_EVERY == 0
        self._seen += 1
        if self.ops is not None:  # (the op watch runs in the next step's forward when that step is sampled)
            self.ops.sample = self._seen % SAMPLE_EVERY == 0
        if not sampled or skipped:
            return
        figs = self.figures(stats, loss, scale)
        self.steps.append(step)
        n = len(self.steps)
        for name, (_, col) in self.series.items():
            hit = figs.pop(name, None)
            col.append(hit[1] if hit is not None else math.nan)
        for name, (kind, v) in figs.items():
            if len(self.series) >= MAX_SERIES:
                break
            col = deque([math.nan] * (n - 1), maxlen=G_WINDOW)
            col.append(v)
            self.series[name] = (kind, col)
        self._recorded += 1
        if self._recorded % JUDGE_EVERY == 0:
            self.judge()

    def figures(self, st: StepStats, loss: float, scale: float | None) -> dict[str, tuple[str, float]]:
        """This step's figure of each culprit: ``{name: (kind, value)}`` (``name`` says the kind in words later)."""
        out: dict[str, tuple[str, float]] = {}
        for name, v in op_figures(st.extra).items():
            out[name] = ("op", v)
        reduced = self.ops.reduced if self.ops is not None else set()
        grads, pgrads = grad_figures(st)
        inv = 1.0 / scale if scale is not None and scale > 0 and math.isfinite(scale) else 1.0
        if grads and reduced:
            seen: set[int] = set()
            for module, outs in _calls(st):  # (inner modules first: an output that is also its parent's is the inner's)
                mine = [t for t in outs if t not in seen]
                seen.update(outs)
                if module not in reduced:
                    continue
                vals = [grads[t] for t in mine if t in grads]
                if vals:
                    v = max(vals) * inv
                    key = f"{module}:grad"
                    prev = out.get(key)
                    out[key] = ("grad", v if prev is None else max(prev[1], v))
        for p, v in pgrads.items():
            if _owner(p, reduced) in reduced or p in self.params_reduced:
                out[f"{p}:pgrad"] = ("pgrad", v)
        if self.loss_dtype == self.dtype and math.isfinite(loss):
            out["<loss>:loss"] = ("loss", abs(loss))
        return out

    def forecast(self) -> list[tuple[str, Forecast]]:
        """(kind, forecast) of each culprit on course to pass the format's max within the horizon, soonest first."""
        if len(self.steps) < 2 or not self.series:
            return []
        names = list(self.series)
        steps = np.array(self.steps, dtype=np.float64)
        a = np.array([list(self.series[k][1]) for k in names], dtype=np.float64).T
        bad = ~np.isfinite(a)
        a = np.where(bad, np.nan, a)
        fcs = forecast(steps, a, bad.astype(np.float64), names, self.fmt.max, self.horizon or DEFAULT_HORIZON,
                       window=G_WINDOW, min_points=G_MIN_POINTS)
        return [(self.series[f.layer][0], f) for f in fcs]

    def judge(self) -> None:
        fresh = [(k, f) for k, f in self.forecast() if f.layer not in self.warned]
        for kind, f in fresh:
            self.warned[f.layer] = f
            if self.speaks:
                alert(growth_alert(kind, f, self.device), self.category, quiet=self.quiet)


def build(model: nn.Module, hooks: Any, fmt: Format, dtype: torch.dtype, *, horizon: int | None, quiet: bool,
          speaks: bool, device: str, category: type[Warning] = UserWarning, watch_ops: bool = False) -> Growth | None:
    """The growth forecast of a Monitor (None without a forecast). The op watch reads the ops only with ``watch_ops``
    (the Monitor's opt-in: a Python call per op on the sampled steps, 1.47x a step on the 386-module bench model);
    without it, only which modules return the format's dtype. Never where a module of the model is compiled (a mode
    active while dynamo traces would change what it compiles)."""
    if horizon is None:
        return None
    root = unwrap(model)
    ops = None
    if type(model).__name__ != "OptimizedModule" and not uses_compile(root):
        ops = OpWatch(root, hooks, dtype, read_ops=watch_ops)
        if getattr(hooks, "tracker", 1) is None:
            hooks.tracker = ops  # attached and detached with the hooks (closed with the Monitor, paused with it)
    held = {n for n, p in root.named_parameters() if p.dtype == dtype}
    g = Growth(fmt, dtype, ops, horizon=horizon, quiet=quiet, speaks=speaks, device=device, params_reduced=held)
    g.category = category
    return g




def note_loss(lookback: Any, loss: Any) -> None:
    """The loop handed over its loss: its dtype says whether the loss itself can pass the format's max."""
    g = getattr(lookback, "growth", None)
    if g is not None:
        g.note_loss(loss)


__all__ = ["KINDS", "Growth", "build", "grad_figures", "note_loss"]
