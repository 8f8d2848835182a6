"""Judge a checkpoint's state (``input.checkpoint.CheckpointState``): is it damaged, where, and how. Codes and
figures only; ``report.check`` words them.

Each rule is a definition, not a tuned threshold:

- ``nonfinite``: a weight, an optimizer state tensor (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's momentum...) or
  GradScaler's scale holds NaN or an infinity.
- ``out_of_range``: a weight's finite values that a cast to the target format overflows (``formats.Format``'s
  exact round-to-nearest-even threshold: FP16 65520, BF16's max plus half an ulp, FP8 E4M3 464): autocast casts
  the weight at every use, so the layer computes with an infinity.
- ``v_flushed``: an Adam element whose second moment ``exp_avg_sq`` is exactly 0 while its first moment
  ``exp_avg`` is not. Both are sums over the same gradients, v = (1-b2) sum b2^j g^2 and m = (1-b1) sum b1^j g,
  so m != 0 means some g != 0 and then v > 0: a zero v is a v that underflowed. In an FP16 state this is the
  common case (v below 2^-24 flushes, i.e. any |g| < about 7.7e-3 at b2 = 0.999), and the update m / (sqrt(v) + eps)
  becomes m / eps (eps = 1e-8 itself flushes to 0 in FP16: m / 0 = inf).
- ``moment_bound``: an Adam element whose |m| exceeds what its own v allows. By Cauchy-Schwarz on the two sums,
  m^2 <= (1-b1)^2 / ((1-b2)(1 - b1^2/b2)) * v, for every gradient history (b1^2 < b2): |m| <= C sqrt(v), C = 7.27
  at Adam's default betas (0.9, 0.999). An element beyond C sqrt(v) (with ``MOMENT_SLACK`` for the rounding of
  FP32 sums) has a moment far beyond the scale its companion moment sets: one of them was damaged. Judged on FP32
  and FP64 states only (FP16/BF16 sums round by more than the bound's margin), where v >= ``FULL_V``.
- ``scale_nonfinite`` / ``scale_zero``: GradScaler's scale is NaN, infinite, or 0 (every scaled gradient is 0);
  ``scale_floor``: the scale reached FP32's subnormal range (below 2^-126): each further back-off loses bits and
  ends at 0; ``scale_collapsed``: the scale is below 1: the gradients overflow FP16 even unscaled, the project's
  definition of a collapse (``judge.scaler``); in a series, also a fall of ``COLLAPSE_BINADES`` or more from the
  first checkpoint's scale.
- ``v_fell`` (in a series): a tensor's exp_avg_sq summed is below what the previous checkpoint's allows. Every update
  gives v' = b2 v + (1-b2) g^2 >= b2 v element by element, so after the k updates between the two (Adam's own
  ``step`` count, which skipped steps do not advance) sum v' >= b2^k sum v. Below it, the second moments were
  reset or flushed between the two checkpoints: the next updates m / sqrt(v) are too large.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ampdoctor.formats import Format
from ampdoctor.input.checkpoint import CheckpointState
from ampdoctor.input.checkpoint_series import optimizer_names
from ampdoctor.judge.scale_facts import COLLAPSE_BINADES

MOMENT_SLACK = 1e-3
"""Relative slack on ``|m| <= C sqrt(v)`` for FP32 rounding: each step rounds v's sum by at most 2u (u = 2^-24),
and the errors decay by b2 a step, so v's relative error stays below 2u / (1-b2) = 1.2e-4 at b2 = 0.999 (m's:
2u / (1-b1)); the slack is ten times that on sqrt(v)'s half of it."""
FULL_V = 2.0**-102
"""The bound is judged where v >= 2^-102 (FP32's smallest normal times 2^24): there each term of v's sum is a normal
number with all 24 bits; below, gradual underflow drops bits of (1-b2) g^2 and v's relative error is unbounded."""
SCALE_FLOOR = 2.0**-126
"""FP32's smallest normal: a GradScaler scale below it is subnormal, and a few more back-offs make it 0."""
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
SKIP_STATE = ("step",)


@dataclass(frozen=True)
class Issue:
    """One damaged tensor."""

    code: str
    """nonfinite | out_of_range | v_flushed | moment_bound | scale_nonfinite | scale_zero | scale_floor | scale_collapsed."""
    part: str
    """'weight', the optimizer state's key (exp_avg, exp_avg_sq, momentum_buffer...), or 'scaler'."""
    name: str
    """The parameter (or buffer) name; '' for the scaler."""
    count: int = 0
    """Elements affected (scale_collapsed: binades fallen from the series' first; v_fell: the updates between)."""
    numel: int = 0
    value: float = 0.0
    """A figure: the largest |x| (out_of_range), the worst |m| / (C sqrt(v)) (moment_bound), the scale (scale_*)."""
    dtype: str = ""

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0] if "." in self.name else self.name


@dataclass
class Health:
    """What ``judge`` found in one checkpoint."""

    issues: list[Issue] = field(default_factory=list)
    tensors: int = 0
    """Tensors looked at (weights and optimizer state)."""
    scale: float | None = None
    """GradScaler's scale when the checkpoint holds one."""
    has_optimizer: bool = False
    adam: bool = False
    """Adam's moments were judged (the optimizer state holds exp_avg and exp_avg_sq)."""
    names_how: str = ""
    """How the optimizer entries were matched to weights ('' when the optimizer saved the names)."""
    second_moments: dict[str, tuple[float, float, float, str]] = field(default_factory=dict)
    """Per parameter: (Adam's step count, the sum of exp_avg_sq in FP64, beta2, dtype), for ``judge_series``."""

    @property
    def damaged(self) -> bool:
        return bool(self.issues)

    def by_module(self) -> dict[str, list[Issue]]:
        out: dict[str, list[Issue]] = {}
        for i in self.issues:
            out.setdefault(i.module, []).append(i)
        return out


def moment_bound(beta1: float, beta2: float) -> float | None:
    """C with |m| <= C sqrt(v) for every gradient history (None when b1^2 >= b2: no such bound)."""
    if not (0 <= beta1 < 1 and 0 < beta2 < 1) or beta1 * beta1 >= beta2:
        return None
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


def _floats(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


def _nonfinite(part: str, name: str, t: torch.Tensor) -> Issue | None:
    bad = int((~torch.isfinite(t)).sum())
    return Issue("nonfinite", part, name, bad, t.numel(), dtype=str(t.dtype).replace("torch.", "")) if bad else None


def _out_of_range(name: str, t: torch.Tensor, fmt: Format) -> Issue | None:
    a = t.detach().float().abs()
    over = torch.isfinite(a) & (a >= fmt.overflow_threshold)
    n = int(over.sum())
    if not n:
        return None
    return Issue("out_of_range", "weight", name, n, t.numel(), float(a[over].max()), str(t.dtype).replace("torch.", ""))


def _weights(model: Mapping[str, torch.Tensor], fmt: Format, h: Health) -> None:
    for name, t in model.items():
        if not _floats(t):
            continue
        h.tensors += 1
        issue = _nonfinite("weight", name, t) or _out_of_range(name, t, fmt)
        if issue is not None:
            h.issues.append(issue)


def _adam(name: str, st: Mapping[str, Any], c: float | None) -> list[Issue]:
    m, v = st.get("exp_avg"), st.get("exp_avg_sq")
    if not (isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and _floats(m) and _floats(v)) or m.shape != v.shape:
        return []
    m, v = m.detach(), v.detach()
    ok = torch.isfinite(m) & torch.isfinite(v)
    out = []
    flushed = ok & (m != 0) & (v == 0)
    if int(flushed.sum()):
        out.append(Issue("v_flushed", "exp_avg_sq", name, int(flushed.sum()), v.numel(), dtype=str(v.dtype).replace("torch.", "")))
    if c is not None and v.dtype in (torch.float32, torch.float64):
        ratio = m.abs().double() / (c * v.double().clamp_min(0).sqrt())
        beyond = ok & (v.double() >= FULL_V) & (ratio > 1 + MOMENT_SLACK)
        if int(beyond.sum()):
            out.append(Issue("moment_bound", "exp_avg", name, int(beyond.sum()), m.numel(), float(ratio[beyond].max()),
                             str(m.dtype).replace("torch.", "")))
    return out


def _optimizer(opt: Mapping[str, Any], model: Mapping[str, torch.Tensor], h: Health) -> None:
    h.has_optimizer = True
    names, h.names_how = optimizer_names(model, opt)
    betas = {i: g.get("betas") for g in opt.get("param_groups") or [] for i in g.get("params", [])}
    for i, st in (opt.get("state") or {}).items():
        if not isinstance(st, Mapping):
            continue
        name = names.get(i, f"optimizer entry {i}")
        for key, t in st.items():
            if key in SKIP_STATE or not _floats(t):
                continue
            h.tensors += 1
            issue = _nonfinite(key, name, t)
            if issue is not None:
                h.issues.append(issue)
        if all(k in st for k in ADAM_KEYS):
            h.adam = True
            b = betas.get(i)
            b1, b2 = (float(b[0]), float(b[1])) if isinstance(b, (tuple, list)) and len(b) == 2 else (None, None)
            c = moment_bound(b1, b2) if b1 is not None and b2 is not None else None
            h.issues += _adam(name, st, c)
            _keep_v(h, name, st, b2)


def _keep_v(h: Health, name: str, st: Mapping[str, Any], beta2: float | None) -> None:
    v, step = st.get("exp_avg_sq"), st.get("step")
    n = float(step.item() if isinstance(step, torch.Tensor) else step) if isinstance(step, (torch.Tensor, int, float)) else None
    if beta2 is None or n is None or not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return
    total = float(v.detach().double().sum())
    if math.isfinite(total):
        h.second_moments[name] = (n, total, beta2, str(v.dtype).replace("torch.", ""))


def scale_value(scaler: Mapping[str, Any] | None) -> float | None:
    if not scaler or "scale" not in scaler:
        return None
    s = scaler["scale"]
    try:
        return float(s.item() if isinstance(s, torch.Tensor) else s)
    except (TypeError, ValueError):
        return None


def _scaler(scale: float | None, h: Health) -> None:
    h.scale = scale
    if scale is None:
        return
    if not math.isfinite(scale):
        h.issues.append(Issue("scale_nonfinite", "scaler", "", value=scale))
    elif scale <= 0:
        h.issues.append(Issue("scale_zero", "scaler", "", value=scale))
    elif scale < SCALE_FLOOR:
        h.issues.append(Issue("scale_floor", "scaler", "", value=scale))
    elif scale < 1:
        h.issues.append(Issue("scale_collapsed", "scaler", "", value=scale))


def judge(state: CheckpointState, fmt: Format) -> Health:
    """Every rule on one checkpoint (``judge_series`` adds what only its neighbours tell)."""
    h = Health()
    _weights(state.model, fmt, h)
    if state.optimizer is not None:
        _optimizer(state.optimizer, state.model, h)
    _scaler(scale_value(state.scaler), h)
    return h


def _v_fell(prev: Health, h: Health) -> list[Issue]:
    """exp_avg_sq summed over a tensor, against its previous checkpoint's: v' = b2 v + (1-b2) g^2 >= b2 v element by
    element at every update, so after k updates (Adam's own step count) sum v' >= b2^k sum v."""
    out = []
    for name, (n, total, b2, dtype) in h.second_moments.items():
        before = prev.second_moments.get(name)
        if before is None or n < before[0] or before[1] <= 0:
            continue
        k = n - before[0]
        floor = before[1] * b2**k
        slack = max(MOMENT_SLACK, 2 * k * 2.0**-24)  # each update rounds v by at most u (FP32) a step
        if total < floor * (1 - slack):
            out.append(Issue("v_fell", "exp_avg_sq", name, int(k), value=total / floor, dtype=dtype))
    return out


def judge_series(healths: list[Health | None]) -> None:
    """What a checkpoint's neighbours tell, added to its issues (``healths`` in step order; None: unreadable):
    GradScaler's scale ``COLLAPSE_BINADES`` or more below the series' first, and Adam's exp_avg_sq below what the
    previous checkpoint's allows (``_v_fell``)."""
    first = next((h.scale for h in healths if h is not None and h.scale is not None and math.isfinite(h.scale)
                  and h.scale > 0), None)
    prev: Health | None = None
    for h in healths:
        if h is None:
            continue
        s = h.scale
        if (first is not None and s is not None and math.isfinite(s) and 1 <= s and math.log2(first / s) >= COLLAPSE_BINADES):
            h.issues.append(Issue("scale_collapsed", "scaler", "", value=s, count=int(math.log2(first / s))))
        if prev is not None:
            h.issues += _v_fell(prev, h)
        prev = h


__all__ = ["ADAM_KEYS", "MOMENT_SLACK", "SCALE_FLOOR", "Health", "Issue", "judge", "judge_series", "moment_bound",
           "scale_value"]
