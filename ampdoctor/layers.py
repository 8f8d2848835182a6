"""Per-layer numeric range picture: what each module's tensors would do when cast to a format.

``layer_stats`` runs a few FP32 reference steps (forward, loss, backward, optimizer step) with hooks
on every module and parameter, and records, per step and per tensor:

- ``act``: each module's forward output (``param`` is ``output``, or ``output[i]`` for several);
- ``act_grad``: the gradient at that output (what flows into the module in backward);
- ``param_grad``: each parameter's gradient;
- ``param``: each parameter's value after the optimizer step.

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
import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from ampdoctor.batches import Batches, materialise, split, to_device
from ampdoctor.errors import BatchError, SpecError, UsageError
from ampdoctor.formats import BF16, Format, get_format
from ampdoctor.hooks import Hooks, StepStats
from ampdoctor.stages import default_optimizer, get_loss
from ampdoctor.stats import BINADE_MIN, NBINADES, NCOLS, Col, StatsBuffer, binade_histogram, tensor_stats

KINDS = ("act", "act_grad", "param", "param_grad")
"""Tensor kinds, in table order: module output, gradient at it, parameter value, parameter gradient."""
GRAD_KINDS = ("act_grad", "param_grad")
WHAT = ("activations", "grads", "weights")
"""What ``what=`` accepts: activations → act; grads → act_grad and param_grad; weights → param."""
DEFAULT_TOLERANCE = 0.01

COLUMNS = [
    "module", "kind", "param", "dtype", "scale", "step", "numel", "absmax", "min_nonzero",
    "overflow_frac", "underflow_frac", "subnormal_frac", "nonfinite_frac", "headroom_binades",
    "min_scale", "max_scale", "zero_frac", "nan_frac", "inf_frac", "order",
]
"""DataFrame columns. ``absmax``/``min_nonzero`` are finite-only, of the values as cast (gradients
times ``scale``); ``min_nonzero`` is NaN for an all-zero tensor. ``headroom_binades`` is
log2(format max / absmax) (inf when absmax is 0). ``min_scale``/``max_scale``: the loss-scale window
(gradients only, NaN otherwise). ``order``: the module's first-seen rank in the step (forward order)."""


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


# windows ------------------------------------------------------------------------------------------


def scale_window(hist: np.ndarray, absmax: float, numel: float, fmt: Format, tolerance: float) -> tuple[float, float]:
    """(min_scale, max_scale) of a gradient for ``fmt``; both powers of two (min 0: no lower limit).

    ``max_scale``: largest 2^k with ``absmax * 2^k < overflow_threshold`` (inf when absmax is 0).
    ``min_scale``: smallest 2^k whose underflow count ``#{0 < |x|*2^k <= 2^u}`` is at most
    ``tolerance * numel``, from the binade histogram ``hist`` (``u = log2(underflow_threshold)``).
    """
    of = fmt.overflow_threshold
    if absmax > 0 and math.isfinite(absmax):
        k = math.floor(math.log2(of / absmax))
        while absmax * 2.0**k >= of:
            k -= 1
        while absmax * 2.0 ** (k + 1) < of:
            k += 1
        hi = 2.0**k
    else:
        hi = math.inf
    u = round(math.log2(fmt.underflow_threshold))
    cum = np.cumsum(hist)  # cum[i]: elements with ceil(log2|x|) <= BINADE_MIN + i
    ok = cum <= tolerance * numel
    if ok.all():
        lo = 0.0
    else:
        e_max = BINADE_MIN + int(np.argmin(ok)) - 1  # largest binade whose prefix count is within tolerance
        lo = 2.0 ** (u - e_max)
    return lo, hi


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
        owner[name] = (mod or "<model>", pname)
    return owner


def _run(model: nn.Module, batches: Batches, fmts: Sequence[Format], scales: Sequence[float], steps: int,
         flags: dict[str, bool], loss_fn: Callable[..., Any] | None, optimizer: torch.optim.Optimizer | None,
         device: torch.device, tolerance: float, seed: int,
         progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """FP32 reference steps from the model's current state; the state (and optimizer's) is restored after."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    opt = optimizer if optimizer is not None else default_optimizer(model.parameters())
    owner = _param_owner(model)
    hooks = _LayerHooks(model, fmts, scales, **flags)
    records: list[dict[str, Any]] = []
    torch.manual_seed(seed)
    try:
        with hooks:
            model.train()
            for step in range(steps):
                if progress is not None:
                    progress(step)
                args, kwargs, target = split(to_device(batches[step], device))
                hooks.begin_step(step)
                opt.zero_grad(set_to_none=True)
                try:
                    loss = get_loss(model(*args, **kwargs), target, loss_fn)
                    loss.backward()
                except Exception as e:  # user code: say where, keep the original as the cause
                    raise SpecError(f"the FP32 reference step {step} raised {type(e).__name__}: {str(e).strip()[:200]}") from e
                hooks.after_backward()
                opt.step()
                hooks.after_step()
                st = hooks.end_step()  # the one host copy of this step
                records.extend(_records(_step_tensors(st, len(fmts), owner), step, fmts, scales, tolerance))
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(opt_state)
    return records


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
) -> pd.DataFrame:
    """Per-layer cast statistics of ``model`` for each format in ``dtypes``, over ``steps`` FP32 steps.

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
    records = _run(model, batches, fmts, [base_scale] * len(fmts), steps, flags, loss_fn, optimizer, dev,
                   underflow_tolerance, seed, progress)
    df = pd.DataFrame.from_records(records, columns=COLUMNS)
    if auto and flags["grads"]:
        chosen = [choose_scale(df, f.name) for f in fmts]
        redo = [(f, c.scale) for f, c in zip(fmts, chosen, strict=True) if c.scale != 1.0]
        if redo:
            grad_flags = {"activations": False, "grads": True, "params": False}
            more = _run(model, batches, [f for f, _ in redo], [s for _, s in redo], steps, grad_flags, loss_fn,
                        optimizer, dev, underflow_tolerance, seed, progress)
            df = pd.concat([df, pd.DataFrame.from_records(more, columns=COLUMNS)], ignore_index=True)
    return df.sort_values(["step", "order", "kind"], kind="stable", key=_kind_key).reset_index(drop=True)


def _kind_key(s: pd.Series) -> pd.Series:
    if s.name == "kind":
        return s.map({k: i for i, k in enumerate(KINDS)})
    return s


# reading the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleChoice:
    """The loss scale the gradient windows of one format allow."""

    dtype: str
    scale: float
    """A power of two: the largest scale that overflows no gradient (1 for bf16 when 1 fits, 1 when
    there are no non-zero gradients)."""
    lo: float
    """Smallest scale keeping every gradient's underflow within the tolerance (0: no lower limit)."""
    hi: float
    """Largest scale overflowing no gradient (inf: no gradient is non-zero)."""
    overflow_limit: str | None
    """The gradient whose window sets ``hi`` ('module kind param, step s')."""
    underflow_limit: str | None
    """The gradient whose window sets ``lo``."""

    @property
    def fits(self) -> bool:
        """True when one scale keeps every gradient free of overflow and within the underflow tolerance."""
        return self.lo <= self.hi


def tensor_name(module: str, kind: str, param: str) -> str:
    """A readable tensor name: 'head.weight', 'blocks.0' (its output), 'lstm[1]' (second output)."""
    if kind in ("act", "act_grad"):
        return module + param[len("output"):]
    return param if module == "<model>" else f"{module}.{param}"


def _label(row: pd.Series) -> str:
    name = tensor_name(str(row["module"]), str(row["kind"]), str(row["param"]))
    if name.isdigit():  # Sequential children are named 0, 1, ...
        name = f"module {name}"
    kind = str(row["kind"])
    what = {"act": f"output of {name}", "act_grad": f"gradient at {name}'s output", "param": name,
            "param_grad": f"gradient of {name}"}.get(kind, name)
    return f"{what} (step {int(row['step'])})"


def choose_scale(df: pd.DataFrame, dtype: str) -> ScaleChoice:
    """The loss scale for ``dtype``: the largest power of two that overflows no gradient in any step.

    That is where GradScaler settles from above. For bf16 (FP32's exponent range) 1 is kept when it
    fits. The limiting gradients are named.
    """
    g = df[(df["dtype"] == dtype) & df["kind"].isin(GRAD_KINDS)]
    if g.empty:
        return ScaleChoice(dtype, 1.0, 0.0, math.inf, None, None)
    hi_row = g.loc[g["max_scale"].idxmin()]
    lo_row = g.loc[g["min_scale"].idxmax()]
    hi, lo = float(hi_row["max_scale"]), float(lo_row["min_scale"])
    scale = hi
    if not math.isfinite(hi) or (dtype == BF16.name and lo <= 1.0 <= hi):
        scale = 1.0
    return ScaleChoice(dtype, scale, lo, hi, _label(hi_row) if math.isfinite(hi) else None,
                       _label(lo_row) if lo > 0 else None)


@dataclass
class Advice:
    """What the table says about one format."""

    dtype: str
    verdict: str
    """'safe' (as is, no loss scale needed), 'safe_with_scale', 'unsafe', or 'fp32_nonfinite'."""
    scale: ScaleChoice
    keep_high: dict[str, str]
    """Module → why it should stay in higher precision."""
    bf16_fixes: bool | None = None
    """For a non-bf16 format, when bf16 rows are present: whether bf16 is safe as is."""
    notes: list[str] = field(default_factory=list)


def _innermost(modules: list[str]) -> list[str]:
    """Drop a module when one of its submodules is also listed (the container only passes it on)."""
    out = []
    for m in modules:
        prefix = "" if m == "<model>" else m + "."
        if any(o != m and (prefix == "" or o.startswith(prefix)) for o in modules):
            continue
        out.append(m)
    return out


def advise(df: pd.DataFrame, dtype: str, tolerance: float = DEFAULT_TOLERANCE) -> Advice:
    """Is ``dtype`` safe for this model as is; which modules to keep in higher precision; the loss scale."""
    d = df[(df["dtype"] == dtype) & ~df["kind"].isin(GRAD_KINDS)]
    choice = choose_scale(df, dtype)
    keep: dict[str, str] = {}
    fp32_bad = df[(df["dtype"] == dtype) & (df["nonfinite_frac"] > 0) & (df["scale"] == 1.0)]
    for kind, what in (("act", "output"), ("param", "weights")):
        k = d[d["kind"] == kind]
        over = list(dict.fromkeys(k.loc[k["overflow_frac"] > 0, "module"]))
        under = list(dict.fromkeys(k.loc[k["underflow_frac"] > tolerance, "module"]))
        for m in _innermost(over):
            keep.setdefault(m, f"{what} overflow {dtype}")
        for m in _innermost(under):
            keep.setdefault(m, f"{what} underflow {dtype} (> {tolerance:.0%})")
    notes = []
    g = df[(df["dtype"] == dtype) & df["kind"].isin(GRAD_KINDS)]
    lo_module = g.loc[g["min_scale"].idxmax(), "module"] if not g.empty else None
    if not choice.fits:
        notes.append(f"no loss scale fits every gradient: {choice.overflow_limit} overflows above {_pow2(choice.hi)} while "
                     f"{choice.underflow_limit} loses more than {tolerance:.0%} to underflow below {_pow2(choice.lo)}")
        if choice.underflow_limit:
            keep.setdefault(str(lo_module), "its gradients underflow at every scale that overflows nothing")
    if not fp32_bad.empty:
        verdict = "fp32_nonfinite"
        notes.insert(0, f"the FP32 reference already has NaN/Inf ({_label(fp32_bad.iloc[0])}): fix that first "
                        "(ampdoctor triage names the cause)")
    elif keep:
        verdict = "unsafe"
    elif choice.lo <= 1.0 <= choice.hi:
        verdict = "safe"
    else:
        verdict = "safe_with_scale"
    advice = Advice(dtype, verdict, choice, keep, notes=notes)
    if dtype != BF16.name and (df["dtype"] == BF16.name).any():
        advice.bf16_fixes = advise(df, BF16.name, tolerance).verdict == "safe"
    return advice


def _pow2(x: float) -> str:
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return "inf"
    return f"2^{round(math.log2(x))}"


SORTS = ("risk", "order", "module", "numel", "absmax", "min_nonzero", "overflow_frac", "underflow_frac", "subnormal_frac",
         "nonfinite_frac", "headroom_binades", "min_scale", "max_scale", "zero_frac")
"""What ``sort_summary`` accepts: risk (NaN/Inf, overflow, underflow, subnormal; worst first), forward order, or a column."""
_ASCENDING = {"order", "module", "min_nonzero", "headroom_binades", "max_scale"}
"""Sort keys whose worst values are the smallest (tables list the worst first)."""


def sort_summary(summary: pd.DataFrame, sort: str) -> pd.DataFrame:
    """``summary`` rows worst first by ``sort`` (one of SORTS; 'order' keeps the forward order)."""
    if sort not in SORTS:
        raise UsageError(f"--sort {sort!r}: choose one of {', '.join(SORTS)}")
    if sort == "order":
        return summary
    if sort == "risk":
        cols = ["nonfinite_frac", "overflow_frac", "underflow_frac", "subnormal_frac"]
        return summary.sort_values(cols, ascending=False, kind="stable")
    return summary.sort_values(sort, ascending=sort in _ASCENDING, kind="stable", na_position="last")


def format_table(df: pd.DataFrame, dtype: str, scale: float | str = 1.0, pattern: str | None = None) -> tuple[float, pd.DataFrame]:
    """(gradient scale, worst-over-steps summary) of one format: what the table of ``dtype`` shows.

    Gradient rows are those at ``scale`` (``"auto"``: the scale ``choose_scale`` picks); ``pattern``
    keeps only the modules it matches (``filter_modules``). The summary is in forward order.
    """
    d = df[df["dtype"] == dtype]
    if pattern is not None:
        d = filter_modules(d, pattern)
    s = choose_scale(df, dtype).scale if isinstance(scale, str) else float(scale)
    d = d[~d["kind"].isin(GRAD_KINDS) | (d["scale"] == s)]
    return s, summarise(d)


def summarise(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (module, kind, param, dtype, scale): the worst value over the steps."""
    keys = ["module", "kind", "param", "dtype", "scale"]
    agg = {"numel": "max", "absmax": "max", "min_nonzero": "min", "overflow_frac": "max", "underflow_frac": "max",
           "subnormal_frac": "max", "nonfinite_frac": "max", "headroom_binades": "min", "min_scale": "max",
           "max_scale": "min", "zero_frac": "max", "nan_frac": "max", "inf_frac": "max", "order": "min", "step": "max"}
    out = df.groupby(keys, sort=False, dropna=False).agg(agg).reset_index()
    return out.sort_values(["order", "kind"], kind="stable", key=_kind_key).reset_index(drop=True)


def filter_modules(df: pd.DataFrame, pattern: str) -> pd.DataFrame:
    """Rows whose module name matches ``pattern`` (re.search); UsageError for a bad pattern."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise UsageError(f"--filter {pattern!r} is not a valid regular expression ({e})") from None
    return df[df["module"].map(lambda m: bool(rx.search(m)))]
