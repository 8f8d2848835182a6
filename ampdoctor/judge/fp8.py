"""The FP8 verdicts: read the FP8 ladder (FP32, BF16 autocast, BF16 + Float8Linear) and its per-GEMM statistics.

Each rule follows from how a scaled FP8 cast works (``ampdoctor.scaled``): ``q = cast(x * s)``, ``s = max / amax``.

1. FP32 or BF16 already fails: not an FP8 problem (``model_bug``; ``bf16_failure``: the BF16 triage names it).
2. **Degenerate scale** (``fp8_degenerate_scale``): a finite operand's scale is infinite, NaN or 0. With amax 0 and no
   floor, ``max / 0`` is inf and ``0 * inf`` is NaN (pytorch/ao#3356); an infinite amax gives the scale 0.
3. **Saturation** (``fp8_saturation``): elements whose ``|x * s|`` reach the format's overflow threshold are
   clamped to ±max. A scale computed from the operand's own amax saturates nothing, so any saturated element
   means the scale came from other values (a stale or delayed amax, a shard's amax).
4. **Gradient underflow** (``fp8_grad_underflow``): at least ``FLUSH_TOLERANCE`` of a layer's output-gradient
   elements, non-zero in BF16, cast to 0 (below the format's smallest subnormal over the scale).
5. **Forward flush** (``fp8_flush``): the same for an input or weight: under tensorwise scaling an outlier row
   sets the scale and the other rows fall below E4M3's smallest subnormal (448 / 2^-9: 17.8 binades).
6. **Precision loss** (``fp8_precision_loss``): the FP8 rung stays finite but its loss over the last steps is
   above BF16's by more than ``SPREAD_FACTOR`` times the spread BF16's own rounding makes (its largest gap to
   FP32 in that window) and by more than ``LOSS_TOLERANCE`` of it; the Linear with the worst SQNR is named.
7. FP8 goes non-finite for none of these reasons (``fp8_nonfinite``): the first operand that arrived non-finite.

Otherwise healthy. Nothing here words: facts and fix codes for ``report.fp8``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ampdoctor.judge.ranges import DEFAULT_TOLERANCE
from ampdoctor.records import Finding, Fix, Outcome
from ampdoctor.scaled import GemmRow

FLUSH_TOLERANCE = DEFAULT_TOLERANCE
"""The share of an operand's non-zero elements that may flush before it is a verdict (``layers``' tolerance)."""
SPREAD_FACTOR = 2.0
"""FP8's loss gap to BF16 must exceed this many times BF16's own gap to FP32 (the spread rounding makes)."""
LOSS_TOLERANCE = 0.01
"""... and this share of BF16's loss: smaller gaps are the same training."""

CAUSES = ("fp8_degenerate_scale", "fp8_saturation", "fp8_grad_underflow", "fp8_flush", "fp8_precision_loss",
          "fp8_nonfinite", "bf16_failure")
"""The causes this module adds (besides ``healthy``, ``model_bug`` and ``inconclusive``)."""


@dataclass
class RungRun:
    """One rung's steps: the loss at each step (NaN where it went non-finite), why it stopped, its GEMM rows."""

    name: str
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    stopped: str | None = None
    gemms: list[GemmRow] = field(default_factory=list)
    recipe: dict[str, Any] | None = None
    error: str | None = None

    @property
    def first_nonfinite(self) -> int | None:
        for i, (lo, g) in enumerate(zip(self.losses, self.grad_norms, strict=True)):
            if not (math.isfinite(lo) and math.isfinite(g)):
                return i
        return None


@dataclass
class Fp8Ladder:
    """The three rungs of an FP8 triage, in order, and how the FP8 one ran."""

    rungs: dict[str, RungRun]
    recipe: str
    device: str
    emulated: bool


def _first(rows: list[GemmRow], pred: Callable[[GemmRow], bool]) -> GemmRow | None:
    """The first row (step order, then the order the GEMMs ran) that ``pred`` holds for."""
    return next((r for r in rows if pred(r)), None)


def _facts(r: GemmRow, **more: Any) -> dict[str, Any]:
    s = r.stats
    return {"module": r.module, "operand": r.operand, "dtype": r.fmt, "step": r.step, "rowwise": r.rowwise,
            "amax": s["amax"], "scale": s["scale"], "saturated": s["saturated"], "flushed": s["flushed"],
            "sqnr_db": s["sqnr_db"], "worst_row": int(s["worst_row"]) if r.rowwise else None,
            "worst_row_flushed": s["worst_row_flushed"], **more}


def _outcome(cause: str, r: GemmRow, fixes: list[Fix], **more: Any) -> Outcome:
    facts = _facts(r, variant=cause, **more)
    finding = Finding(cause, "error", stage="fp8", module=r.module, step=r.step, evidence=dict(facts))
    return Outcome(cause, r.module, r.step, "fp8", facts, [finding], fixes)


def _keep(module: str) -> Fix:
    return Fix("fp8_keep_bf16", {"module": module})


def degenerate(lad: Fp8Ladder, rows: list[GemmRow]) -> Outcome | None:
    r = _first(rows, lambda r: r.stats["nonfinite"] == 0 and (not math.isfinite(r.stats["scale"]) or r.stats["scale"] == 0))
    if r is None:
        return None
    return _outcome("fp8_degenerate_scale", r, [Fix("fp8_amax_floor", {"module": r.module, "operand": r.operand}),
                                                 _keep(r.module)], zero_amax=r.stats["min_row_amax"] == 0)


def saturation(lad: Fp8Ladder, rows: list[GemmRow]) -> Outcome | None:
    r = _first(rows, lambda r: r.stats["saturated"] > 0)
    if r is None:
        return None
    return _outcome("fp8_saturation", r, [Fix("fp8_fresh_amax", {"module": r.module}), _keep(r.module)])


def _flush_fixes(lad: Fp8Ladder, r: GemmRow) -> list[Fix]:
    """Rowwise scaling where it would keep the values (its what-if flushed share is under the tolerance: the
    flushed values sit in other rows than the largest); else the span of the format is the limit."""
    rowwise = not r.rowwise and r.stats["rowwise_flushed"] < FLUSH_TOLERANCE
    fixes = [Fix("fp8_rowwise", {"module": r.module, "rowwise_flushed": r.stats["rowwise_flushed"]})] if rowwise else []
    if not rowwise:
        fixes.append(Fix("fp8_span", {"module": r.module, "operand": r.operand, "dtype": r.fmt}))
    return [*fixes, _keep(r.module)]


def grad_underflow(lad: Fp8Ladder, rows: list[GemmRow]) -> Outcome | None:
    r = _first(rows, lambda r: r.operand == "grad_output" and r.stats["flushed"] >= FLUSH_TOLERANCE)
    if r is None:
        return None
    return _outcome("fp8_grad_underflow", r, _flush_fixes(lad, r))


def flush(lad: Fp8Ladder, rows: list[GemmRow]) -> Outcome | None:
    r = _first(rows, lambda r: r.operand != "grad_output" and r.stats["flushed"] >= FLUSH_TOLERANCE)
    if r is None:
        return None
    return _outcome("fp8_flush", r, _flush_fixes(lad, r))


def loss_gap(lad: Fp8Ladder) -> dict[str, float] | None:
    """The last steps' mean losses of each rung, FP8's gap to BF16 and BF16's spread (None: too few steps)."""
    f32, b16, f8 = (lad.rungs[k].losses for k in ("fp32", "bf16", "fp8"))
    n = min(len(f32), len(b16), len(f8))
    if n < 4:
        return None
    w = max(3, n // 4)
    a, b, c = f32[n - w:n], b16[n - w:n], f8[n - w:n]
    if not all(math.isfinite(v) for v in a + b + c):
        return None
    spread = max(abs(x - y) for x, y in zip(b, a, strict=True))
    mb, mc = sum(b) / w, sum(c) / w
    return {"window": w, "fp32_loss": sum(a) / w, "bf16_loss": mb, "fp8_loss": mc, "gap": mc - mb, "spread": spread}


def worst_sqnr(rows: list[GemmRow]) -> list[tuple[str, str, float]]:
    """(module, operand, mean SQNR in dB) of every operand, the lowest first."""
    acc: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if math.isfinite(r.stats["sqnr_db"]):
            acc.setdefault((r.module, r.operand), []).append(r.stats["sqnr_db"])
    out = [(m, o, sum(v) / len(v)) for (m, o), v in acc.items()]
    return sorted(out, key=lambda t: t[2])


def precision_loss(lad: Fp8Ladder, rows: list[GemmRow]) -> Outcome | None:
    g = loss_gap(lad)
    if g is None or lad.rungs["fp8"].first_nonfinite is not None:
        return None
    if not (g["gap"] > SPREAD_FACTOR * g["spread"] and g["gap"] > LOSS_TOLERANCE * abs(g["bf16_loss"])):
        return None
    ranked = worst_sqnr(rows)
    if not ranked:
        return None
    module, operand, db = ranked[0]
    r = _first(rows, lambda r: r.module == module and r.operand == operand)
    assert r is not None
    fixes = [_keep(module)] + ([Fix("fp8_rowwise", {"module": module})] if lad.recipe == "tensorwise" else [])
    start = departure(lad)
    out = _outcome("fp8_precision_loss", r, fixes, mean_sqnr_db=db, ranked=[list(t) for t in ranked[:5]], **g)
    out.findings[0].step = start
    return Outcome(out.cause, out.module, start, "fp8", {**out.facts, "step": start}, out.findings, out.fixes)


def departure(lad: Fp8Ladder) -> int:
    """The first step from which FP8's loss stays above BF16's by more than ``SPREAD_FACTOR`` times BF16's gap
    to FP32 at every step (the step the FP8 run leaves BF16's)."""
    f32, b16, f8 = (lad.rungs[k].losses for k in ("fp32", "bf16", "fp8"))
    n = min(len(f32), len(b16), len(f8))
    start = n
    for t in range(n - 1, -1, -1):
        if not f8[t] - b16[t] > SPREAD_FACTOR * abs(b16[t] - f32[t]):
            break
        start = t
    return min(start, n - 1)


def nonfinite(lad: Fp8Ladder, rows: list[GemmRow]) -> Outcome | None:
    bad = lad.rungs["fp8"].first_nonfinite
    if bad is None:
        return None
    r = _first(rows, lambda r: r.stats["nonfinite"] > 0)
    if r is None:
        return Outcome("fp8_nonfinite", None, bad, "fp8", {"variant": "fp8_nonfinite", "step": bad}, [], [])
    return _outcome("fp8_nonfinite", r, [_keep(r.module)])


RULES = (degenerate, saturation, grad_underflow, flush, nonfinite, precision_loss)
"""In order: the first rule that returns an Outcome decides the verdict."""


def _before_fp8(lad: Fp8Ladder) -> Outcome | None:
    """FP32 or BF16 fails already: the FP8 rung is not the cause."""
    for name, cause in (("fp32", "model_bug"), ("bf16", "bf16_failure")):
        run = lad.rungs[name]
        bad = run.first_nonfinite
        if run.error is not None or bad is not None:
            facts = {"variant": f"{name}_fails", "step": bad, "error": run.error}
            fix = [Fix("fp8_triage_bf16", {})] if name == "bf16" else []
            return Outcome(cause, None, bad, name, facts, [Finding(cause, "error", stage=name, step=bad)], fix)
    return None


def judge(lad: Fp8Ladder) -> Outcome:
    """The FP8 verdict of a ladder (``engine.fp8.run_ladder``)."""
    early = _before_fp8(lad)
    if early is not None:
        return early
    fp8 = lad.rungs["fp8"]
    if fp8.error is not None:
        return Outcome("inconclusive", None, None, "fp8", {"variant": "fp8_raised", "error": fp8.error}, [], [])
    bad = fp8.first_nonfinite
    rows = [r for r in fp8.gemms if bad is None or r.step <= bad]
    for rule in RULES:
        out = rule(lad, rows)
        if out is not None:
            return out
    g = loss_gap(lad)
    return Outcome("healthy", None, None, "fp8", {"variant": "healthy", **(g or {}),
                                                  "ranked": [list(t) for t in worst_sqnr(fp8.gemms)[:3]]}, [], [])
