"""Plain records that every layer reads: stats rows, step statistics, step records, stage results,
and the verdicts and findings the rules return.

Nothing here computes or prints; the engine fills these, the rules judge them, the reports carry them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch


class Col:
    """Column indices of a stats row."""

    NUMEL = 0
    ZERO = 1
    """Exactly zero already."""
    UNDERFLOW = 2
    """Non-zero, casts to 0."""
    SUBNORMAL = 3
    """Casts to a non-zero subnormal."""
    NORMAL = 4
    OVERFLOW = 5
    """Finite, casts to ±inf (or is clamped)."""
    POSINF = 6
    NEGINF = 7
    NAN = 8
    ABSMAX = 9
    """Largest finite |x| (0 when there is none)."""
    MIN_NONZERO = 10
    """Smallest finite non-zero |x| (inf when there is none)."""


NCOLS = 11


BINADE_MIN = -149
"""Smallest ceil(log2|x|) of a non-zero float32 (the smallest subnormal, 2^-149)."""


BINADE_MAX = 128
"""Largest ceil(log2|x|) of a finite float32 (just below 2^128)."""


NBINADES = BINADE_MAX - BINADE_MIN + 1


MODEL = "<model>"
"""The model's own name among its modules (``named_modules()`` names it ""): in calls, findings, layer rows, rings."""
LABELS = "<labels>"
"""A model input no module reads, only the model's own code: the batch's labels, read by its loss (``judge.locate``)."""


class Call(NamedTuple):
    """One forward call of a module in a step.

    A tuple of a string and tuples of ints: once Python's cyclic GC has seen it, it stops tracking it, so a
    step's hundreds of calls are never promoted into the old generation (whose full collections, with
    torch loaded, take over 100 ms)."""

    module: str
    inputs: Sequence[int]
    """Tensor ids (per step) of the floating inputs."""
    outputs: Sequence[int]
    """Tensor ids (per step) of the floating outputs."""


@dataclass
class StepStats:
    """What the monitor saw in one step, on the host. Rows are stats rows (see ``stats.Col``)."""

    step: int
    calls: list[Call] = field(default_factory=list)
    act: dict[int, np.ndarray] = field(default_factory=dict)
    """Forward value of each tensor id."""
    grad: dict[int, np.ndarray] = field(default_factory=dict)
    """Gradient w.r.t. each tensor id."""
    grad_order: list[int] = field(default_factory=list)
    """Tensor ids in the order their gradients arrived in backward."""
    pgrad: dict[str, np.ndarray] = field(default_factory=dict)
    param: dict[str, np.ndarray] = field(default_factory=dict)
    model_inputs: Sequence[int] = field(default_factory=list)
    model_outputs: Sequence[int] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)
    """Scalars the caller queued with ``Hooks.add_scalar`` (loss, norms, ...)."""
    tail: Any = None
    """The vector queued with ``Hooks.add_tail`` (float64 on the host), and its layout: ``(layout, values)``."""
    flat_calls: list[tuple[list[str], list[int], list[int], list[int]]] = field(default_factory=list, repr=False,
                                                                                 compare=False)
    """Calls not yet made into ``Call`` objects (the C++ recorder's, see ``calls``): chunks of (module names,
    module indices, bounds, tensor ids) as ``fused.tap_take`` returns a step's calls."""

    def set_rows(self, keys: list[tuple[str, Any]], rows: np.ndarray, finite: tuple[str, ...] = ()) -> None:
        """The step's rows as they came off the device: ``rows[i]`` is the row of ``keys[i] = (kind, ident)``,
        ``kind`` one of act, grad, pgrad, param. The four dicts are made from them on first read (a step nobody
        reads makes no Python object per row); ``any_nonfinite`` and ``has`` read the matrix itself. ``finite``:
        kinds whose rows the recorder already knows count no NaN or infinity (``any_nonfinite`` then reads
        nothing: a step's matrix is out of cache by the time the verdict asks)."""
        self.__dict__["_pending_rows"] = (keys, rows)
        self.__dict__["_finite_kinds"] = finite

    @property
    def row_matrix(self) -> tuple[list[tuple[str, Any]], np.ndarray] | None:
        """(keys, rows) as ``set_rows`` got them, while no dict has been made from them (else None)."""
        return self.__dict__.get("_pending_rows")  # type: ignore[no-any-return]

    def any_nonfinite(self, kind: str) -> bool:
        """Whether any row of ``kind`` (act, grad, pgrad, param) counts a NaN or an infinity."""
        pend = self.__dict__.get("_pending_rows")
        if pend is not None:
            if kind in self.__dict__.get("_finite_kinds", ()) and not self.__dict__["_" + kind]:
                return False  # (the recorder's word for the matrix, and no row put in by hand)
            rows = pend[1]
            if not len(rows) or not (rows[:, Col.POSINF] + rows[:, Col.NEGINF] + rows[:, Col.NAN] > 0).any():
                return any(nonfinite(r) > 0 for r in self.__dict__["_" + kind].values())  # (rows put in by hand)
        return any(nonfinite(r) > 0 for r in getattr(self, kind).values())

    def has(self, kind: str) -> bool:
        """Whether the step holds any row of ``kind``."""
        pend = self.__dict__.get("_pending_rows")
        if pend is not None and any(k[0] == kind for k in pend[0]):
            return True
        return bool(self.__dict__["_" + kind])

    def _materialise(self) -> None:
        pend = self.__dict__.pop("_pending_rows", None)
        if pend is None:
            return
        d = self.__dict__
        into = {"act": d["_act"], "grad": d["_grad"], "pgrad": d["_pgrad"], "param": d["_param"]}
        for (kind, ident), row in zip(pend[0], pend[1], strict=True):
            into[kind][ident] = row

    def _calls_get(self) -> list[Call]:
        out = self.__dict__["_calls"]
        if self.flat_calls:  # made on first read: a step nobody reads creates no Python object per call
            for names, mods, bounds, tids in self.flat_calls:
                out.extend([Call(names[m], tuple(tids[bounds[2 * k]: bounds[2 * k + 1]]),
                                 tuple(tids[bounds[2 * k + 1]: bounds[2 * k + 2]])) for k, m in enumerate(mods)])
            self.flat_calls.clear()
        return out  # type: ignore[no-any-return]

    def _calls_set(self, value: list[Call]) -> None:
        self.__dict__["_calls"] = value
        self.flat_calls = []


# ``calls`` is a property over the dataclass field of that name (set by __init__ through the setter): the
# Monitor records hundreds of calls a step, and making each a Python object at once (three per call, alive
# across a young collection) drove full collections of the cyclic GC: 130 ms every ~20 steps with torch loaded
StepStats.calls = property(StepStats._calls_get, StepStats._calls_set)  # type: ignore[assignment]


def _rows_property(kind: str) -> property:
    """``StepStats.act`` (and grad, pgrad, param): the dict, made from ``set_rows``' matrix on first read."""
    slot = "_" + kind

    def get(self: StepStats) -> dict[Any, np.ndarray]:
        if "_pending_rows" in self.__dict__:
            self._materialise()
        return self.__dict__[slot]  # type: ignore[no-any-return]

    def put(self: StepStats, value: dict[Any, np.ndarray]) -> None:
        if "_pending_rows" in self.__dict__:
            self._materialise()
        self.__dict__[slot] = value

    return property(get, put)


for _kind in ("act", "grad", "pgrad", "param"):
    setattr(StepStats, _kind, _rows_property(_kind))


def nonfinite(row: np.ndarray) -> float:
    """Number of NaN/±Inf elements in a stats row."""
    return float(row[Col.POSINF] + row[Col.NEGINF] + row[Col.NAN])


@dataclass
class StepRecord:
    """One step, as a triage stage or the Monitor saw it: the step-log columns, plus what was measured.

    Built by ``engine.driver.step_record`` (its skip reason by ``engine.driver.skip_reason``)."""

    step: int
    batch: int | None
    """The index of the step's batch in the cached batches (a stage's; None in the user's own loop)."""
    lr: float | None
    loss: float
    grad_l2_pre_clip: float
    grad_l2_post_clip: float
    skipped: bool
    skip_reason: str
    """'' | 'nonfinite_loss' | 'nonfinite_grad[:<module>]' | 'nonfinite_from_rank:<r>' | 'skipped_by_caller' on a
    skipped step; 'applied:<reason>' on a step applied with a non-finite loss or gradient."""
    scaler_scale: float | None
    """The scale this step used (None without a GradScaler)."""
    params_finite: bool = True
    update_swallowed_frac: float | None = None
    """fp16 stage: share of non-zero updates that FP16 weights would round away."""
    scale_after: float | None = None
    """The scale after this step's ``scaler.update()``."""
    skip_rate: float = 0.0
    """The Monitor's rolling skip rate over its last ``window`` steps, this one included."""
    nonfinite_params: list[str] = field(default_factory=list)
    """Parameters whose gradient held NaN/Inf (all of them on recorded steps; else the first)."""
    nonfinite_count: int = 0
    """How many parameters had a non-finite gradient."""
    injected: str = ""
    """'inf:<param>' or 'spike' when the monitor injected a fault at this step."""
    stats: StepStats | None = None
    """The Monitor's per-layer statistics of this step (``keep_stats``; a stage keeps them in ``StageResult.stats``)."""
    tripped: bool = False
    """Sentinel mode: this step tripped the sentinel (its full statistics were taken, and the next
    ``full_after`` steps are recorded in full)."""
    capture: str = ""
    """The capture folder written at this step ('' if none; see ``ampdoctor.capture``)."""
    rank: int | None = None
    """Under torch.distributed: this process's rank."""
    ranks: Any = None
    """Under torch.distributed: the ranks that saw a non-finite value at this step, the same on every rank
    (an ``parallel.exchange.RankView``)."""
    capture_held: int | None = None
    """With a capture armed: the host bytes it holds after this step."""
    step_convention: str | None = None
    """Under a framework: what ``step`` counts (``STEP_CONVENTIONS``)."""

    def row(self) -> dict[str, Any]:
        """The Monitor's step-log row (standard columns, then its extra columns)."""
        names = self.nonfinite_params[:8]
        more = self.nonfinite_count - len(names)
        return {
            "step": self.step, "lr": self.lr, "grad_l2_pre_clip": self.grad_l2_pre_clip,
            "grad_l2_post_clip": self.grad_l2_post_clip, "loss": self.loss, "skipped": self.skipped,
            "skip_reason": self.skip_reason, "scaler_scale": self.scaler_scale, "scale_after": self.scale_after,
            "skip_rate": round(self.skip_rate, 6),
            "nonfinite_params": ";".join(names) + (f";+{more}" if more > 0 else ""), "injected": self.injected,
            **({"capture_held_bytes": self.capture_held} if self.capture_held is not None else {}),
            **({"step_convention": self.step_convention} if self.step_convention is not None else {}),
            **({"rank": self.rank, "ranks": self.ranks.column() if self.ranks is not None else ""}
               if self.rank is not None else {}),
        }


@dataclass
class StageError:
    """An exception raised by user code (or an unsupported kernel) during a stage."""

    type: str
    message: str
    step: int
    module: str | None
    hint: str
    custom_function: str | None = None
    """Raised in the backward of this custom autograd.Function (its name), when it was one."""


@dataclass
class UserHook:
    """A gradient or tensor hook the user's code put on the model (``watch.userhooks.found``), by name."""

    kind: str
    """'gradient hook' | 'post-accumulate-grad hook' | 'full backward hook' | 'backward pre-hook'"""
    target: str
    """'parameter' | 'module'"""
    name: str
    """The parameter's or module's qualified name."""
    hook: str
    """The hook function's qualified name ('spec.build_model.<locals>.<lambda>')."""
    where: str = ""
    """'file.py:line' of its definition, when known."""
    ops: list[str] = field(default_factory=list)
    """Operations its source names that rewrite values (nan_to_num, clamp...)."""

    def describe(self) -> str:
        """'gradient hook <lambda> (spec.py:12, nan_to_num) on parameter fc1.weight'."""
        short = self.hook.rsplit(".", 1)[-1] if self.hook else "?"
        detail = ", ".join([x for x in [self.where, *self.ops] if x])
        return f"{self.kind} {short}" + (f" ({detail})" if detail else "") + f" on {self.target} {self.name}"

    def as_json(self) -> dict[str, object]:
        return {"kind": self.kind, "target": self.target, "name": self.name, "hook": self.hook, "where": self.where,
                "ops": list(self.ops)}

    @classmethod
    def from_json(cls, d: object) -> UserHook | None:
        if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in ("kind", "target", "name", "hook")):
            return None
        ops = d.get("ops")
        return cls(d["kind"], d["target"], d["name"], d["hook"], str(d.get("where") or ""),
                   [str(o) for o in ops] if isinstance(ops, list) else [])


@dataclass
class StageResult:
    name: str
    records: list[StepRecord] = field(default_factory=list)
    stats: list[StepStats] = field(default_factory=list)
    error: StageError | None = None
    stopped: str | None = None
    """Why the stage stopped after its last record: 'nonfinite_weights' | 'nonfinite_loss' (``engine.driver.STOPS``);
    None when it ran every step."""
    optimizer_underflow: list[str] = field(default_factory=list)
    """Optimizer constants that round to 0 in FP16 (e.g. 'eps=1e-08')."""
    master_weights: bool = True
    snapshot: dict[str, torch.Tensor] | None = None
    """FP32 weights before the first faulty step (target stage only), for the FP32 re-check."""
    snapshot_step: int | None = None
    applied_snapshot: dict[str, torch.Tensor] | None = None
    """FP32 weights before the first step applied with a non-finite or exploding gradient norm (target stage only):
    a replay of that step without the user's gradient hooks tells whether they hid an overflow from GradScaler."""
    applied_step: int | None = None
    hook_inputs_nonfinite: dict[int, list[str]] = field(default_factory=dict)
    """Step → the parameters / modules whose gradient was already non-finite when a user's gradient hook was handed
    it (``watch.userhooks.Probe``; target stage of a model with hooks)."""
    applied_rng: torch.Tensor | None = None
    """The torch RNG state as that step began (its replay draws the same dropout)."""
    weight_decay: dict[str, float] = field(default_factory=dict)
    """Parameter → its optimizer group's weight decay, where it is not 0 (decay moves a weight, learning or not)."""
    moved: dict[str, float] = field(default_factory=dict)
    """‖w_end − w_0‖ per parameter over the steps run (the weights the optimizer stepped)."""

    @property
    def first_nonfinite_step(self) -> int | None:
        for r in self.records:
            if not math.isfinite(r.loss) or not math.isfinite(r.grad_l2_pre_clip) or not r.params_finite:
                return r.step
        return None

    @property
    def skipped_steps(self) -> list[int]:
        return [r.step for r in self.records if r.skipped]


def stats_at(res: StageResult | None, step: int) -> StepStats | None:
    """The statistics a stage recorded at ``step`` (None: no such stage, or that step was not recorded)."""
    if res is None:
        return None
    return next((s for s in res.stats if s.step == step), None)


@dataclass
class Verdict:
    cause: str
    """One of CAUSES."""
    first_module: str | None
    first_step: int | None
    stage: str | None
    summary: str = ""
    """Written from the rule's facts by ``report.words`` when the Report is built."""
    device: str = "cpu"


@dataclass
class Finding:
    code: str
    """A cause from CAUSES, or a warning code such as 'calibration_skips'."""
    severity: str
    """error | warning | info"""
    title: str = ""
    """Written from the code and evidence by ``report.words`` when the Report is built."""
    stage: str | None = None
    module: str | None = None
    step: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    """Written by ``report.words`` when the Report is built."""


@dataclass
class Fix:
    """One change to make, as data: ``report.words`` turns the code and facts into a sentence."""

    code: str
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """What a rule found, as data: the verdict (cause, module, step, stage), the facts its words need
    (``facts["variant"]`` names the wording; keys ``step`` and ``*_step`` are step numbers), its
    findings (no prose: code, severity, stage, module, step, evidence) and its fixes."""

    cause: str
    module: str | None
    step: int | None
    stage: str | None
    facts: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)


@dataclass
class LayerRow:
    module: str
    kind: str
    """activation | grad | param_grad | op (an operation inside the module, found by the FP32 op scan)"""
    absmax_fp32: float
    """Largest finite |x| seen in the FP32 stage."""
    overflow_frac: float
    """Share of elements that overflow in FP16 (cast of the FP32 values)."""
    underflow_frac: float
    """Share of FP32-non-zero elements that are zero in the target stage (flushed)."""
    nonfinite_frac: float
    """Share of NaN/Inf in the target stage."""
    headroom_binades: float
    """log2(65504 / absmax_fp32)."""
    first_nonfinite_step: int | None = None


@dataclass
class ScaleEvent:
    step: int
    scale: float
    reason: str


@dataclass
class ScalerStory:
    init_scale: float
    final_scale: float
    min_scale: float
    max_scale: float
    calibration_skips: int
    skips: list[ScaleEvent]
    pattern: str
    """calibrating | stable | climbing | saturated | oscillating | collapsed | never_growing"""
    explanation: str
