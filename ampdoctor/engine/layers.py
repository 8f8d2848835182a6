"""Per-layer numeric range picture: what each module's tensors would do when cast to a format.

``layer_stats`` runs a few FP32 reference steps (forward, loss, backward, optimizer step) with hooks
on every module and parameter, and records, per step and per tensor:

- ``act``: each module's forward output (``param`` is ``output``, or ``output[i]`` for several);
- ``act_grad``: the gradient at that output (what flows into the module in backward);
- ``param_grad``: each parameter's gradient;
- ``param``: each parameter's value as the step's forward used it (before that step's update).

Every tensor is reduced on its device for all requested formats at once (``stats.tensor_stats``
per format, plus one ``stats.binade_histogram`` per gradient), the rows of a step are stacked and
copied to the host once per step. The fractions are exactly what ``tensor.to(dtype)`` does (see
``ampdoctor.formats``); for the saturating FP8 E4M3 cast, ``|x| >= 464`` (where a non-saturating
cast would leave the format) counts as overflow although torch clamps it to ±448.

Gradients are multiplied by ``scale`` before the cast test (what GradScaler does); their
**loss-scale window** is the largest power-of-two scale that overflows nothing (``max_scale``) and
the smallest that keeps the underflow fraction at or below the tolerance (``min_scale``; 0 when
no scale is too small). Windows do not depend on ``scale``.

Nothing here prints or exits: errors are ``AmpDoctorError`` subclasses.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from ampdoctor.engine.driver import Driver
from ampdoctor.engine.forward import default_optimizer
from ampdoctor.engine.step import TrainStep
from ampdoctor.errors import BatchError, SpecError, UsageError
from ampdoctor.formats import Format, get_format
from ampdoctor.input.batches import Batches, materialise
from ampdoctor.judge.opscan import InnerOp, InnerOps
from ampdoctor.judge.ranges import (  # noqa: F401 - re-exported: the layers API reads as one module
    COLUMNS,
    DEFAULT_TOLERANCE,
    GRAD_KINDS,
    KINDS,
    SORTS,
    WHAT,
    Advice,
    ScaleChoice,
    _kind_key,
    advise,
    choose_scale,
    filter_modules,
    format_table,
    scale_window,
    sort_summary,
    summarise,
    tensor_name,
)
from ampdoctor.ladder import FP32
from ampdoctor.records import MODEL, NBINADES, NCOLS, Col, StepStats
from ampdoctor.watch.hooks import Hooks
from ampdoctor.watch.stats import StatsBuffer, binade_histogram, tensor_stats

# on-device reduction ------------------------------------------------------------------------------


class _MultiFormatBuffer(StatsBuffer):
    """A StatsBuffer whose rows hold every format's stats, a binade histogram and the unscaled absmax.

    Row layout: ``len(fmts)`` blocks of ``NCOLS`` (format i, gradients times ``grad_scales[i]``),
    then ``NBINADES`` histogram counts (gradients only, zeros otherwise), then the absmax of the
    unscaled values (gradients only). Like StatsBuffer, ``add`` queues references and reduces
    batches on their device; ``collect`` returns one device tensor (no host synchronisation).
    """

    def __init__(self, fmts: Sequence[Format], grad_scales: Sequence[float],
                 flush_numel: int = 1 << 22, big_numel: int = 1 << 20) -> None:
        super().__init__(fmts[0], flush_numel, big_numel)
        self.fmts = list(fmts)
        self.grad_scales = [float(s) for s in grad_scales]
        self.width = len(self.fmts) * NCOLS + NBINADES + 1
        self._queue: dict[tuple[torch.device, bool], tuple[list[Hashable], list[torch.Tensor]]] = {}
        self._qnumel: dict[tuple[torch.device, bool], int] = {}
        self._done_keys: list[Hashable] = []
        self._done_rows: list[torch.Tensor] = []

    def _reduce(self, tensors: list[torch.Tensor], is_grad: bool) -> torch.Tensor:
        n, device = len(tensors), tensors[0].device
        parts = [tensor_stats(tensors, f, s if is_grad else 1.0) for f, s in zip(self.fmts, self.grad_scales, strict=True)]
        if is_grad:
            parts.append(binade_histogram(tensors))
            if all(s == 1.0 for s in self.grad_scales):
                parts.append(parts[0][:, Col.ABSMAX : Col.ABSMAX + 1])
            else:
                parts.append(tensor_stats(tensors, self.fmts[0], 1.0)[:, Col.ABSMAX : Col.ABSMAX + 1])
        else:
            parts.append(torch.zeros((n, NBINADES + 1), dtype=torch.float64, device=device))
        return torch.cat(parts, dim=1)

    def add(self, key: Hashable, tensor: torch.Tensor) -> None:
        t = tensor.detach()
        is_grad = isinstance(key, tuple) and key[0] in ("grad", "pgrad")
        if t.numel() >= self.big_numel:
            self._done_keys.append(key)
            self._done_rows.append(self._reduce([t], is_grad))
            return
        slot = (t.device, is_grad)
        keys, ts = self._queue.setdefault(slot, ([], []))
        keys.append(key)
        ts.append(t)
        self._qnumel[slot] = self._qnumel.get(slot, 0) + t.numel()
        if self._qnumel[slot] >= self.flush_numel:
            self._flush_slot(slot)

    def add_many(self, keys: list[Hashable], tensors: list[torch.Tensor], numel: int, mixed: bool = False) -> None:
        for k, t in zip(keys, tensors, strict=True):
            self.add(k, t)

    def _flush_slot(self, slot: tuple[torch.device, bool]) -> None:
        keys, ts = self._queue.pop(slot, ([], []))
        self._qnumel.pop(slot, None)
        if ts:
            self._done_keys.extend(keys)
            self._done_rows.append(self._reduce(ts, slot[1]))

    def __len__(self) -> int:
        return len(self._done_keys) + sum(len(k) for k, _ in self._queue.values())

    def collect(self) -> tuple[list[Hashable], torch.Tensor]:
        for slot in list(self._queue):
            self._flush_slot(slot)
        keys, rows = self._done_keys, self._done_rows
        self._done_keys, self._done_rows = [], []
        if not rows:
            return keys, torch.zeros((0, self.width), dtype=torch.float64)
        target = rows[0].device
        return keys, torch.cat([r.to(target, non_blocking=True) for r in rows])


class _LayerHooks(Hooks):
    """Hooks whose rows carry every requested format (the buffer is the only difference)."""

    def __init__(self, model: nn.Module, fmts: Sequence[Format], grad_scales: Sequence[float], **flags: bool) -> None:
        super().__init__(model, fmts[0], **flags)
        self._buf = _MultiFormatBuffer(fmts, grad_scales)


# the reference steps ------------------------------------------------------------------------------


@dataclass
class _Acc:
    """Stats of one (module, kind, param) in one step, summed over the module's calls."""

    module: str
    kind: str
    param: str
    order: int
    row: np.ndarray
    tids: set[int] = field(default_factory=set)


def _combine(a: np.ndarray, b: np.ndarray, nf: int) -> np.ndarray:
    """Merge two wide rows of disjoint tensors: counts add, absmax max, min_nonzero min."""
    out = a + b
    for i in range(nf):
        base = i * NCOLS
        out[base + Col.ABSMAX] = max(a[base + Col.ABSMAX], b[base + Col.ABSMAX])
        out[base + Col.MIN_NONZERO] = min(a[base + Col.MIN_NONZERO], b[base + Col.MIN_NONZERO])
    out[-1] = max(a[-1], b[-1])
    return out


def _step_tensors(st: StepStats, nf: int, param_owner: dict[str, tuple[str, str]]) -> list[_Acc]:
    """Per (module, kind, param) wide rows of one step, in first-seen order."""
    accs: dict[tuple[str, str, str], _Acc] = {}
    rank: dict[str, int] = {}  # modules in first-seen order (forward order, then parameter owners)

    def put(module: str, kind: str, param: str, tid: int | None, row: np.ndarray) -> None:
        key = (module, kind, param)
        acc = accs.get(key)
        if acc is None:
            order = rank.setdefault(module, len(rank))
            accs[key] = _Acc(module, kind, param, order, row.copy(), {tid} if tid is not None else set())
        elif tid is None or tid not in acc.tids:
            acc.row = _combine(acc.row, row, nf)
            if tid is not None:
                acc.tids.add(tid)

    for call in st.calls:
        n = len(call.outputs)
        for j, tid in enumerate(call.outputs):
            label = "output" if n == 1 else f"output[{j}]"
            if tid in st.act:
                put(call.module, "act", label, tid, st.act[tid])
    for call in st.calls:
        n = len(call.outputs)
        for j, tid in enumerate(call.outputs):
            if tid in st.grad:
                put(call.module, "act_grad", "output" if n == 1 else f"output[{j}]", tid, st.grad[tid])
    for name, (module, pname) in param_owner.items():
        if name in st.param:
            put(module, "param", pname, None, st.param[name])
    for name, (module, pname) in param_owner.items():
        if name in st.pgrad:
            put(module, "param_grad", pname, None, st.pgrad[name])
    return list(accs.values())


def _records(accs: list[_Acc], step: int, fmts: Sequence[Format], scales: Sequence[float], tolerance: float) -> list[dict[str, Any]]:
    nf = len(fmts)
    out = []
    for acc in accs:
        is_grad = acc.kind in GRAD_KINDS
        hist = acc.row[nf * NCOLS : nf * NCOLS + NBINADES]
        for i, fmt in enumerate(fmts):
            r = acc.row[i * NCOLS : (i + 1) * NCOLS]
            numel = float(r[Col.NUMEL])
            den = max(numel, 1.0)
            absmax = float(r[Col.ABSMAX])
            minnz = float(r[Col.MIN_NONZERO])
            if is_grad:
                lo, hi = scale_window(hist, float(acc.row[-1]), numel, fmt, tolerance)
            else:
                lo = hi = math.nan
            out.append({
                "module": acc.module, "kind": acc.kind, "param": acc.param, "dtype": fmt.name,
                "scale": scales[i] if is_grad else 1.0, "step": step, "numel": int(numel),
                "absmax": absmax, "min_nonzero": minnz if math.isfinite(minnz) else math.nan,
                "overflow_frac": r[Col.OVERFLOW] / den, "underflow_frac": r[Col.UNDERFLOW] / den,
                "subnormal_frac": r[Col.SUBNORMAL] / den,
                "nonfinite_frac": (r[Col.POSINF] + r[Col.NEGINF] + r[Col.NAN]) / den,
                "headroom_binades": fmt.headroom_binades(absmax), "min_scale": lo, "max_scale": hi,
                "zero_frac": r[Col.ZERO] / den, "nan_frac": r[Col.NAN] / den,
                "inf_frac": (r[Col.POSINF] + r[Col.NEGINF]) / den, "order": acc.order,
            })
    return out


def _param_owner(model: nn.Module) -> dict[str, tuple[str, str]]:
    owner = {}
    for name, _ in model.named_parameters():
        mod, _, pname = name.rpartition(".")
        owner[name] = (mod or MODEL, pname)
    return owner


def _run(model: nn.Module, batches: Batches, fmts: Sequence[Format], scales: Sequence[float], steps: int,
         flags: dict[str, bool], loss_fn: Callable[..., Any] | None, optimizer: torch.optim.Optimizer | None,
         device: torch.device, tolerance: float, seed: int,
         progress: Callable[[int], None] | None = None, max_norm: float | None = None,
         inner: list[InnerOp] | None = None) -> list[dict[str, Any]]:
    """FP32 reference steps from the model's current state; the state (and optimizer's) is restored after.
    ``inner``: filled with the ops inside modules of step 0's forward (``opscan.InnerOps``), largest first."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    opt = optimizer if optimizer is not None else default_optimizer(model.parameters())
    owner = _param_owner(model)
    hooks = _LayerHooks(model, fmts, scales, **flags)
    records: list[dict[str, Any]] = []
    torch.manual_seed(seed)
    # the one step recipe, FP32; a plain loop applies whatever its gradients hold
    recipe = TrainStep(model, opt, None, precision=FP32, hooks=hooks, skip_nonfinite=False, max_norm=max_norm)
    driver = Driver(recipe, loss_fn, device)
    try:
        with hooks:
            model.train()
            for step in range(steps):
                if progress is not None:
                    progress(step)
                driver.begin(step)
                scan = InnerOps(model) if inner is not None and step == 0 else None
                try:
                    driver.accumulate(batches[step], _within(scan) if scan is not None else None)
                except Exception as e:  # user code: say where, keep the original as the cause
                    raise SpecError(f"the FP32 reference step {step} raised {type(e).__name__}: {str(e).strip()[:200]}") from e
                if scan is not None and inner is not None:
                    inner.extend(scan.ops)
                m, _ = driver.measure()  # the one host copy of this step
                driver.apply(m)
                assert m.stats is not None
                records.extend(_records(_step_tensors(m.stats, len(fmts), owner), step, fmts, scales, tolerance))
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(opt_state)
    return records


def _within(scan: InnerOps) -> Callable[[], InnerOps]:
    """The context each forward of a step runs in: the op scan (``opscan.InnerOps``)."""
    return lambda: scan


INNER_OPS = 64
"""The largest ops inside modules that ``layer_stats`` keeps (``df.attrs["inner_ops"]``)."""


# public API ---------------------------------------------------------------------------------------


def parse_what(what: str | Iterable[str]) -> tuple[str, ...]:
    """'activations,grads' or an iterable of names → a validated tuple (UsageError otherwise)."""
    items = [w.strip().lower() for w in (what.split(",") if isinstance(what, str) else what) if w.strip()]
    aliases = {"acts": "activations", "activation": "activations", "grad": "grads", "gradients": "grads",
               "weight": "weights", "params": "weights", "parameters": "weights"}
    items = [aliases.get(w, w) for w in items]
    bad = [w for w in items if w not in WHAT]
    if bad or not items:
        raise UsageError(f"unknown --what {bad[0] if bad else '(empty)'!r}; choose from {', '.join(WHAT)} (comma-separated)")
    return tuple(dict.fromkeys(items))


def parse_dtypes(dtypes: str | Iterable[str]) -> list[Format]:
    """'fp16,bf16' or an iterable of names → Formats (UsageError for an unknown or unavailable one)."""
    names = [d for d in (dtypes.split(",") if isinstance(dtypes, str) else dtypes) if str(d).strip()]
    if not names:
        raise UsageError("no format given; use e.g. --dtype fp16 or --dtype fp16,bf16")
    fmts = [get_format(str(n)) for n in names]
    return list({f.name: f for f in fmts}.values())


def layer_stats(
    model: nn.Module,
    batches: Iterable[Any] | Batches,
    dtypes: str | Sequence[str] = ("fp16",),
    steps: int = 3,
    scale: float | str = 1.0,
    what: str | Sequence[str] = WHAT,
    loss_fn: Callable[..., Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: str | torch.device | None = None,
    underflow_tolerance: float = DEFAULT_TOLERANCE,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    max_norm: float | None = None,
) -> pd.DataFrame:
    """Per-layer cast statistics of ``model`` for each format in ``dtypes``, over ``steps`` FP32 steps.

    ``max_norm``: clip the global gradient norm in the reference steps, as ``triage --max-norm`` does
    in every stage (so the two commands see the same weights).
    ``batches``: an iterable of batches (``(inputs, targets)``, a dict, or a tensor; cycled when
    shorter than ``steps``). ``loss_fn(output, target)`` defaults to the model's own loss;
    ``optimizer`` defaults to AdamW(lr=1e-3). ``scale``: gradients are multiplied by it before
    the cast test; ``"auto"`` picks, per format, the scale the loss-scale windows allow (see
    ``choose_scale``) and adds the gradient rows at that scale to the scale-1 rows. The model (and
    the optimizer's state) is restored after the steps; the model must be FP32. ``progress(step)``
    is called before each step (twice over the steps with ``scale="auto"``).

    Returns one row per (module, kind, param, dtype, scale, step) with the columns ``COLUMNS``.
    Raises UsageError for bad arguments, SpecError when the model fails in FP32.
    """
    fmts = parse_dtypes(dtypes)
    flags_what = parse_what(what)
    if steps < 1:
        raise UsageError(f"steps must be at least 1 (got {steps})")
    if max_norm is not None and not max_norm > 0:
        raise UsageError(f"--max-norm must be positive, e.g. --max-norm 1.0 (got {max_norm})")
    if not 0 <= underflow_tolerance < 1:
        raise UsageError(f"the underflow tolerance must be in [0, 1) (got {underflow_tolerance})")
    auto = isinstance(scale, str)
    if auto and str(scale).strip().lower() != "auto":
        raise UsageError(f"scale must be a positive number or 'auto' (got {scale!r})")
    base_scale = 1.0 if auto else float(scale)
    if not (base_scale > 0 and math.isfinite(base_scale)):
        raise UsageError(f"scale must be a positive number or 'auto' (got {scale!r})")
    params = list(model.parameters())
    if not params:
        raise UsageError("the model has no parameters")
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in params):
        raise UsageError("layer_stats runs FP32 reference steps; pass model.float()")
    dev = torch.device(device) if device is not None else params[0].device
    if not isinstance(batches, Batches):
        try:
            batches = materialise(batches, steps)
        except BatchError as e:
            raise UsageError(str(e)) from None
    flags = {"activations": "activations" in flags_what, "grads": "grads" in flags_what, "params": "weights" in flags_what}
    inner: list[InnerOp] = []
    records = _run(model, batches, fmts, [base_scale] * len(fmts), steps, flags, loss_fn, optimizer, dev,
                   underflow_tolerance, seed, progress, max_norm=max_norm, inner=inner if flags["activations"] else None)
    df = pd.DataFrame.from_records(records, columns=COLUMNS)
    if auto and flags["grads"]:
        chosen = [choose_scale(df, f.name) for f in fmts]
        redo = [(f, c.scale) for f, c in zip(fmts, chosen, strict=True) if c.scale != 1.0]
        if redo:
            grad_flags = {"activations": False, "grads": True, "params": False}
            more = _run(model, batches, [f for f, _ in redo], [s for _, s in redo], steps, grad_flags, loss_fn,
                        optimizer, dev, underflow_tolerance, seed, progress, max_norm=max_norm)
            df = pd.concat([df, pd.DataFrame.from_records(more, columns=COLUMNS)], ignore_index=True)
    df = df.sort_values(["step", "order", "kind"], kind="stable", key=_kind_key).reset_index(drop=True)
    # what module hooks cannot see: the ops inside modules (step 0), for the advice to name (ranges.inner_overflows)
    df.attrs["inner_ops"] = [asdict(o) for o in inner[:INNER_OPS]]
    return df


