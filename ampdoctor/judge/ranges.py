"""Reading the per-layer range table (``ampdoctor layers``): loss-scale windows, the scale to use,
which layers to keep in higher precision, and the sorted summary the renderers show.

Pure functions over the DataFrame that ``engine.layers.layer_stats`` returns; nothing runs a model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from ampdoctor.errors import UsageError
from ampdoctor.formats import BF16, Format, get_format
from ampdoctor.records import BINADE_MIN, MODEL

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




def _kind_key(s: pd.Series) -> pd.Series:
    if s.name == "kind":
        return s.map({k: i for i, k in enumerate(KINDS)})
    return s


# reading the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorAt:
    """One tensor of the table at one step: the row that sets a limit (``report.words.layers.tensor`` words it)."""

    module: str
    kind: str
    """act | act_grad | param | param_grad (``KINDS``)."""
    param: str
    step: int


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
    overflow_limit: TensorAt | None
    """The gradient whose window sets ``hi``."""
    underflow_limit: TensorAt | None
    """The gradient whose window sets ``lo``."""

    @property
    def fits(self) -> bool:
        """True when one scale keeps every gradient free of overflow and within the underflow tolerance."""
        return self.lo <= self.hi


def tensor_name(module: str, kind: str, param: str) -> str:
    """A readable tensor name: 'head.weight', 'blocks.0' (its output), 'lstm[1]' (second output)."""
    if kind in ("act", "act_grad"):
        return module + param[len("output"):]
    return param if module == MODEL else f"{module}.{param}"


def _at(row: pd.Series) -> TensorAt:
    return TensorAt(str(row["module"]), str(row["kind"]), str(row["param"]), int(row["step"]))


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
    return ScaleChoice(dtype, scale, lo, hi, _at(hi_row) if math.isfinite(hi) else None, _at(lo_row) if lo > 0 else None)


@dataclass(frozen=True)
class KeepReason:
    """Why a module should stay in higher precision (``report.words.layers.keep_reason`` words it)."""

    code: Literal["overflow", "underflow", "no_scale", "inner_op"]
    """overflow / underflow: its ``kind``'s values overflow ``dtype`` / underflow it beyond ``tolerance``;
    no_scale: its gradients underflow at every scale that overflows nothing; inner_op: an op inside it (``op``)
    reaches ``absmax`` in FP32, beyond ``dtype``'s ``max``, while its output fits."""
    dtype: str
    kind: str = ""
    """act | param (overflow, underflow)."""
    tolerance: float = 0.0
    op: str = ""
    absmax: float = 0.0
    max: float = 0.0


@dataclass(frozen=True)
class Note:
    """A note on a format's advice (``report.words.layers.note`` words it)."""

    code: Literal["fp32_nonfinite", "no_scale_fits", "inner_unseen"]
    """fp32_nonfinite: the FP32 reference already has NaN/Inf (at ``at``); no_scale_fits: ``overflow`` overflows
    above ``hi`` while ``underflow`` loses more than ``tolerance`` below ``lo``; inner_unseen: no row shows the
    ``op`` inside ``module``."""
    at: TensorAt | None = None
    overflow: TensorAt | None = None
    underflow: TensorAt | None = None
    hi: float = 0.0
    lo: float = 0.0
    tolerance: float = 0.0
    module: str = ""
    op: str = ""


@dataclass
class Advice:
    """What the table says about one format."""

    dtype: str
    verdict: str
    """'safe' (as is, no loss scale needed), 'safe_with_scale', 'unsafe', or 'fp32_nonfinite'."""
    scale: ScaleChoice
    keep_high: dict[str, KeepReason]
    """Module → why it should stay in higher precision."""
    bf16_fixes: bool | None = None
    """For a non-bf16 format, when bf16 rows are present: whether bf16 is safe as is."""
    notes: list[Note] = field(default_factory=list)
    inner: list[dict[str, Any]] = field(default_factory=list)
    """Ops inside modules (``df.attrs["inner_ops"]``) that overflow the format while their module's output fits:
    ``{module, op, absmax}``, the largest op per module. No module row shows them."""


def inner_overflows(df: pd.DataFrame, dtype: str, fitting: Any = ()) -> list[dict[str, Any]]:
    """The first op per module (in forward order), among the ops inside modules that ``layer_stats`` scanned,
    whose FP32 value overflows ``dtype``; modules in ``fitting`` (already named for their own output) are left out."""
    fmt = get_format(dtype)
    out: dict[str, dict[str, Any]] = {}
    for o in sorted(df.attrs.get("inner_ops", []), key=lambda o: o.get("index", 0)):
        if o["absmax"] >= fmt.overflow_threshold and o["module"] not in fitting and o["module"] not in out:
            out[o["module"]] = {"module": o["module"], "op": o["op"], "absmax": float(o["absmax"]),
                                "overflow_frac": float(o["overflow_frac"].get(dtype, 0.0))}
    return list(out.values())


def _innermost(modules: list[str]) -> list[str]:
    """Drop a module when one of its submodules is also listed (the container only passes it on)."""
    out = []
    for m in modules:
        prefix = "" if m == MODEL else m + "."
        if any(o != m and (prefix == "" or o.startswith(prefix)) for o in modules):
            continue
        out.append(m)
    return out


def advise(df: pd.DataFrame, dtype: str, tolerance: float = DEFAULT_TOLERANCE) -> Advice:
    """Is ``dtype`` safe for this model as is; which modules to keep in higher precision; the loss scale."""
    d = df[(df["dtype"] == dtype) & ~df["kind"].isin(GRAD_KINDS)]
    choice = choose_scale(df, dtype)
    keep: dict[str, KeepReason] = {}
    fp32_bad = df[(df["dtype"] == dtype) & (df["nonfinite_frac"] > 0) & (df["scale"] == 1.0)]
    for kind in ("act", "param"):
        k = d[d["kind"] == kind]
        over = list(dict.fromkeys(k.loc[k["overflow_frac"] > 0, "module"]))
        under = list(dict.fromkeys(k.loc[k["underflow_frac"] > tolerance, "module"]))
        for m in _innermost(over):
            keep.setdefault(m, KeepReason("overflow", dtype, kind))
        for m in _innermost(under):
            keep.setdefault(m, KeepReason("underflow", dtype, kind, tolerance))
    notes = []
    g = df[(df["dtype"] == dtype) & df["kind"].isin(GRAD_KINDS)]
    lo_module = g.loc[g["min_scale"].idxmax(), "module"] if not g.empty else None
    if not choice.fits:
        notes.append(Note("no_scale_fits", overflow=choice.overflow_limit, underflow=choice.underflow_limit,
                          hi=choice.hi, lo=choice.lo, tolerance=tolerance))
        if choice.underflow_limit:
            keep.setdefault(str(lo_module), KeepReason("no_scale", dtype))
    inner = inner_overflows(df, dtype, set(keep)) if dtype != BF16.name else []
    for o in inner:
        keep.setdefault(o["module"], KeepReason("inner_op", dtype, op=o["op"], absmax=o["absmax"],
                                                max=get_format(dtype).max))
    if inner:
        notes.append(Note("inner_unseen", module=inner[0]["module"], op=inner[0]["op"]))
    if not fp32_bad.empty:
        verdict = "fp32_nonfinite"
        notes.insert(0, Note("fp32_nonfinite", at=_at(fp32_bad.iloc[0])))
    elif keep:
        verdict = "unsafe"
    elif choice.lo <= 1.0 <= choice.hi:
        verdict = "safe"
    else:
        verdict = "safe_with_scale"
    advice = Advice(dtype, verdict, choice, keep, notes=notes, inner=inner)
    if dtype != BF16.name and (df["dtype"] == BF16.name).any():
        advice.bf16_fixes = advise(df, BF16.name, tolerance).verdict == "safe"
    return advice


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
