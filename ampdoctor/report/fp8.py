"""The FP8 triage's report as plain data, and its words: the verdict, the rungs, the per-GEMM table, the fixes.

``judge.fp8`` returns an ``Outcome`` (codes and figures); this module writes it in English, once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ampdoctor.fmt import num, pct
from ampdoctor.judge.fp8 import Fp8Ladder
from ampdoctor.records import Outcome
from ampdoctor.scaled import GemmRow

TITLES = {
    "healthy": "FP8 trains like BF16",
    "fp8_degenerate_scale": "FP8 degenerate scale",
    "fp8_saturation": "FP8 saturation",
    "fp8_grad_underflow": "FP8 gradient underflow",
    "fp8_flush": "FP8 operand flushed to zero",
    "fp8_precision_loss": "FP8 precision loss",
    "fp8_nonfinite": "FP8 non-finite",
    "bf16_failure": "BF16 fails already",
    "model_bug": "fails in FP32 too",
    "inconclusive": "FP8 rung could not run",
}

OPERAND_WORDS = {"input": "input", "weight": "weight", "grad_output": "output gradient"}


def _where(f: dict[str, Any]) -> str:
    return f"the {OPERAND_WORDS.get(f.get('operand', ''), f.get('operand', ''))} of {f.get('module')} ({f.get('dtype')})"


def summary(o: Outcome, lad: Fp8Ladder) -> str:
    """The verdict in one paragraph, from its facts."""
    f = o.facts
    c = o.cause
    if c == "healthy":
        gap = f.get("gap")
        tail = f" (last {f['window']} steps: FP8 loss {num(f['fp8_loss'])}, BF16 {num(f['bf16_loss'])})" if gap is not None else ""
        return f"FP32, BF16 and BF16 + Float8Linear ({lad.recipe}) train alike{tail}; nothing saturates or flushes."
    if c == "model_bug":
        return "The FP32 rung fails already: not a precision problem. Run `ampdoctor triage` without --target fp8."
    if c == "bf16_failure":
        return (f"The BF16 rung goes non-finite at step {f.get('step')} before any FP8 cast: run "
                "`ampdoctor triage SPEC --target bf16` for its cause.")
    if c == "inconclusive":
        return f"The FP8 rung raised {f.get('error')}."
    if c == "fp8_degenerate_scale":
        zero = "amax 0" if f.get("zero_amax") else f"amax {num(f['amax'])}"
        return (f"At step {o.step} {_where(f)} has {zero}: its FP8 scale max / amax is {num(f['scale'])}, and "
                "casting with it gives NaN (0 x inf) or zeros, while BF16 stays finite.")
    if c == "fp8_saturation":
        return (f"At step {o.step} {pct(f['saturated'])} of {_where(f)} saturate at the format's max: the scale "
                f"{num(f['scale'])} came from other values than these (a stale or delayed amax, a shard's amax).")
    if c in ("fp8_grad_underflow", "fp8_flush"):
        row = f" (rowwise: worst row {f['worst_row']}, {pct(f['worst_row_flushed'])} flushed)" if f.get("rowwise") else ""
        return (f"At step {o.step} {pct(f['flushed'])} of {_where(f)}, non-zero in BF16, are cast to 0: below the "
                f"format's smallest subnormal over the scale {num(f['scale'])} set by amax {num(f['amax'])}{row}.")
    if c == "fp8_precision_loss":
        return (f"FP8 stays finite but its loss leaves BF16's from step {o.step}: last {f['window']} steps "
                f"{num(f['fp8_loss'])} against {num(f['bf16_loss'])} (BF16's own spread to FP32: {num(f['spread'])}). "
                f"The least precise GEMM operand is {_where(f)}, SQNR {num(f['mean_sqnr_db'])} dB.")
    if c == "fp8_nonfinite":
        return f"The FP8 rung goes non-finite at step {o.step}" + (f"; {_where(f)} arrives non-finite first." if o.module else ".")
    return c


def fix_words(code: str, facts: dict[str, Any], recipe: str) -> str:
    m = facts.get("module")
    return {
        "fp8_keep_bf16": f"Keep {m} in BF16: convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != '{m}').",
        "fp8_rowwise": f"Use one scale per row: --fp8-recipe rowwise (Float8LinearConfig.from_recipe_name('rowwise')); "
                       f"{recipe} scaling gives the whole tensor one scale.",
        "fp8_amax_floor": "Bound amax below before computing the scale (torchao Float8Linear uses 1e-12; "
                          "Float8DynamicActivationFloat8WeightConfig(activation_value_lb=1e-12)).",
        "fp8_fresh_amax": f"Compute {m}'s scale from the amax of the tensor being cast (dynamic scaling), reduced over "
                          "every shard that holds it.",
        "fp8_span": f"The flushed values of {m} lie in the same rows as its largest, more than the format's span "
                    f"({facts.get('dtype')}) below them: bring them closer (e.g. an auxiliary loss weighted near the main "
                    "one), or keep the layer in BF16.",
        "fp8_triage_bf16": "Run `ampdoctor triage SPEC --target bf16` to name the BF16 failure.",
    }.get(code, code)


@dataclass
class Fp8Report:
    """The FP8 triage report, plain data (``--json`` writes it as is)."""

    cause: str
    title: str
    module: str | None
    operand: str | None
    step: int | None
    stage: str | None
    summary: str
    recipe: str
    emulated: bool
    rungs: list[dict[str, Any]] = field(default_factory=list)
    gemms: list[dict[str, Any]] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 0 if self.cause == "healthy" else 2 if self.cause == "inconclusive" else 1

    def to_dict(self) -> dict[str, Any]:
        return _plain(asdict(self))


def _plain(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


def gemm_table(rows: list[GemmRow], focus: str | None = None, limit: int = 12) -> list[dict[str, Any]]:
    """Per (module, operand): the worst figures over the steps (largest saturated and flushed shares, lowest
    SQNR, smallest scale), the verdict's module first, then by flushed share and SQNR."""
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        s = r.stats
        a = acc.setdefault((r.module, r.operand), {"module": r.module, "operand": r.operand, "dtype": r.fmt,
                                                   "amax": 0.0, "scale": math.inf, "saturated": 0.0, "flushed": 0.0,
                                                   "sqnr_db": math.inf, "step": r.step})
        a["amax"] = max(a["amax"], s["amax"]) if math.isfinite(s["amax"]) else s["amax"]
        a["scale"] = min(a["scale"], s["scale"]) if not math.isnan(s["scale"]) else s["scale"]
        if s["flushed"] > a["flushed"] or s["saturated"] > a["saturated"]:
            a["step"] = r.step
        a["saturated"] = max(a["saturated"], s["saturated"])
        a["flushed"] = max(a["flushed"], s["flushed"])
        if not math.isnan(s["sqnr_db"]):
            a["sqnr_db"] = min(a["sqnr_db"], s["sqnr_db"])
    out = sorted(acc.values(), key=lambda a: (a["module"] != focus, -a["saturated"] - a["flushed"], a["sqnr_db"]))
    return out[:limit]


def build(o: Outcome, lad: Fp8Ladder, first: int = 0) -> Fp8Report:
    """The report; ``first``: the run's step number of the ladder's step 0 (a replayed capture), added to every step."""
    rungs: list[dict[str, Any]] = []
    for name, run in lad.rungs.items():
        last = next((v for v in reversed(run.losses) if math.isfinite(v)), math.nan)
        bad = run.first_nonfinite
        rungs.append({"rung": name, "steps": len(run.losses), "first_nonfinite": None if bad is None else bad + first,
                      "loss": run.losses[-1] if run.losses else math.nan, "last_finite_loss": last, "error": run.error})
    fp8 = lad.rungs.get("fp8")
    table = gemm_table(fp8.gemms if fp8 else [], o.module)
    if first:
        o = Outcome(o.cause, o.module, None if o.step is None else o.step + first, o.stage,
                    {**o.facts, **({"step": o.facts["step"] + first} if o.facts.get("step") is not None else {})},
                    o.findings, o.fixes)
        for g in table:
            g["step"] += first
    return Fp8Report(o.cause, TITLES.get(o.cause, o.cause), o.module, o.facts.get("operand"), o.step, o.stage,
                     summary(o, lad), lad.recipe, lad.emulated, rungs, table,
                     [fix_words(f.code, f.facts, lad.recipe) for f in o.fixes], dict(o.facts))


def alert_words(kind: str, step: int, module: str, operand: str, dtype: str, value: float) -> str:
    """The Monitor's message for one FP8 GEMM alert (``engine.fp8_watch.GemmAlert``)."""
    what = f"the {OPERAND_WORDS.get(operand, operand)} of {module} ({dtype})"
    if kind == "degenerate":
        return (f"FP8 at step {step}: {what} has a degenerate scale ({num(value)}): its amax is 0 or not finite; "
                "bound amax below or keep the layer in BF16 (docs/fp8.md)")
    if kind == "saturated":
        return f"FP8 at step {step}: {pct(value)} of {what} saturate: its scale came from other values (docs/fp8.md)"
    if kind == "flushed":
        return (f"FP8 at step {step}: {pct(value)} of {what}, non-zero in high precision, flush to 0 in the cast "
                "(docs/fp8.md)")
    return (f"FP8 at step {step}: the amax of {what} falls steadily and reaches the amax floor in about "
            f"{int(value)} steps, where its scale degenerates (docs/fp8.md)")
