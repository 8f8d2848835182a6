"""What the rules measure on a stage's records, as numbers: the first bad step, the calibration steps, the
parameters whose gradients flush, the overflows GradScaler masks, the first module that flushes, the layer table,
the stall ratio, an outlier batch field, a module's largest output or gradient, the share of updates swallowed."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ampdoctor.formats import FP16
from ampdoctor.input.batches import Batches, absmax_ratio, fields, outlier_ratio
from ampdoctor.judge import locate
from ampdoctor.judge.progress import loss_window
from ampdoctor.judge.thresholds import FLUSH_THRESHOLD, MIN_STALL_STEPS, OUTLIER_RATIO
from ampdoctor.records import Col, LayerRow, StageResult, StepStats, nonfinite
from ampdoctor.records import stats_at as _stats_at


def stall_ratio(target: StageResult, fp32: StageResult) -> float | None:
    """How much of FP32's loss progress the target makes over the same steps (1: as much, 0: none).

    Both stages start from the same weights and see the same batch at every step, so the
    comparison is step by step: ``(head32 - tail_t) / (head32 - tail32)``, where head is the mean
    loss over the first quarter of the steps and tail over the last quarter (means over a window
    damp the batch-to-batch noise). None when FP32 made no meaningful progress (under 1% of its
    head) or there are too few steps to tell.
    """
    w = loss_window(target, fp32, MIN_STALL_STEPS)  # the windows, kept for the words
    return w.ratio if w is not None else None


def underflowing_params(target: StageResult, fp32: StageResult, steps: int = 5) -> list[tuple[str, float]]:
    """(param, median flushed share) for params above FLUSH_THRESHOLD, in backward order."""
    fr: dict[str, list[float]] = {}
    for st, ref in zip(target.stats[:steps], fp32.stats[:steps], strict=False):
        for p, row in st.pgrad.items():
            r = ref.pgrad.get(p)
            if r is None or nonfinite(row) > 0 or nonfinite(r) > 0:
                continue
            fr.setdefault(p, []).append(locate.flushed_frac(row, r))
    out = [(p, float(np.median(v))) for p, v in fr.items() if v and np.median(v) > FLUSH_THRESHOLD]
    if out and target.stats:
        order = locate.backward_order(target.stats[0])
        rank = {m: i for i, m in enumerate(order)}
        out.sort(key=lambda pv: rank.get(pv[0].rsplit(".", 1)[0], 1 << 30))
    return out


def masked_overflows(target: StageResult, fp32: StageResult, steps: int = 5) -> list[tuple[str, int, float]]:
    """(param, step, fp32 absmax x scale) where AMP applied a finite gradient that is mostly zero
    although FP32's gradient times the loss scale exceeds FP16's range.

    In FP16 arithmetic such a scaled gradient must become inf, which GradScaler would see and skip;
    a finite zero instead means something between backward and unscale_ replaced the overflow.
    """
    out = []
    for rec, st, ref in zip(target.records[:steps], target.stats[:steps], fp32.stats[:steps], strict=False):
        if rec.skipped or rec.scaler_scale is None:
            continue
        for p, row in st.pgrad.items():
            r = ref.pgrad.get(p)
            if r is None or nonfinite(row) > 0 or nonfinite(r) > 0:
                continue
            scaled = float(r[Col.ABSMAX]) * rec.scaler_scale
            if scaled >= FP16.overflow_threshold and locate.flushed_frac(row, r) > FLUSH_THRESHOLD:
                out.append((p, rec.step, scaled))
    return out


def first_bad_step(res: StageResult, amp: bool) -> int | None:
    """First step with a fault: non-finite loss or weights, forward fault, or (plain stages) grads."""
    for r, st in zip(res.records, res.stats, strict=False):
        if not math.isfinite(r.loss) or not r.params_finite or locate.forward_fault(st):
            return r.step
        if not amp and not math.isfinite(r.grad_l2_pre_clip):
            return r.step
    return None


def layer_table(results: dict[str, StageResult], target: str, limit: int = 12, focus: str | None = None) -> list[LayerRow]:
    """Per module: FP32 absmax and FP16 overflow share of its output, flushed share of its
    parameter gradients, non-finite share in the target stage."""
    fp32, tgt = results.get("fp32"), results.get(target)
    if fp32 is None or not fp32.stats:
        return []
    rows: dict[tuple[str, str], LayerRow] = {}

    def row(module: str, kind: str) -> LayerRow:
        key = (module, kind)
        if key not in rows:
            rows[key] = LayerRow(module, kind, 0.0, 0.0, 0.0, 0.0, math.inf)
        return rows[key]

    for st in fp32.stats:
        for c in st.calls:
            for t in c.outputs:
                r = st.act.get(t)
                if r is None or r[Col.NUMEL] == 0:
                    continue
                lr = row(c.module, "activation")
                lr.absmax_fp32 = max(lr.absmax_fp32, float(r[Col.ABSMAX]))
                lr.overflow_frac = max(lr.overflow_frac, float(r[Col.OVERFLOW] / r[Col.NUMEL]))
                g = st.grad.get(t)
                if g is not None and g[Col.NUMEL]:
                    gr = row(c.module, "grad")
                    gr.absmax_fp32 = max(gr.absmax_fp32, float(g[Col.ABSMAX]))
                    gr.overflow_frac = max(gr.overflow_frac, float(g[Col.OVERFLOW] / g[Col.NUMEL]))
        for p, r in st.pgrad.items():
            if r[Col.NUMEL]:
                pr = row(p, "param_grad")
                pr.absmax_fp32 = max(pr.absmax_fp32, float(r[Col.ABSMAX]))
                pr.overflow_frac = max(pr.overflow_frac, float(r[Col.OVERFLOW] / r[Col.NUMEL]))
    if tgt is not None:
        calib = set(calibration_steps(tgt)) if target == "amp" else set()
        for st in tgt.stats:
            for c in st.calls:
                for t in c.outputs:
                    r = st.act.get(t)
                    if r is not None and r[Col.NUMEL] and (c.module, "activation") in rows:
                        lr = rows[(c.module, "activation")]
                        frac = nonfinite(r) / r[Col.NUMEL]
                        if frac > 0 and lr.first_nonfinite_step is None:
                            lr.first_nonfinite_step = st.step
                        lr.nonfinite_frac = max(lr.nonfinite_frac, frac)
            for p, r in st.pgrad.items():
                if st.step in calib:  # GradScaler's calibration skips are expected to hold inf gradients
                    break
                if r[Col.NUMEL] and (p, "param_grad") in rows:
                    pr = rows[(p, "param_grad")]
                    frac = nonfinite(r) / r[Col.NUMEL]
                    if frac > 0 and pr.first_nonfinite_step is None:
                        pr.first_nonfinite_step = st.step
                    pr.nonfinite_frac = max(pr.nonfinite_frac, frac)
        for p, f in underflowing_params(tgt, fp32, steps=len(tgt.stats)):
            if (p, "param_grad") in rows:
                rows[(p, "param_grad")].underflow_frac = f
    for lrow in rows.values():
        lrow.headroom_binades = FP16.headroom_binades(lrow.absmax_fp32)
    # keep the interesting rows: non-finite, overflow, flushed, or thin headroom
    def score(r: LayerRow) -> tuple[float, ...]:
        return (r.nonfinite_frac > 0, r.overflow_frac, r.underflow_frac, -r.headroom_binades)
    interesting = [r for r in rows.values() if r.nonfinite_frac > 0 or r.overflow_frac > 0
                   or r.underflow_frac > 0 or r.headroom_binades < 2]
    # leaf-most modules first: a container only repeats its last child's output
    names = locate.innermost(r.module for r in interesting if r.kind == "activation")
    interesting = [r for r in interesting if r.kind != "activation" or r.module in names]
    interesting.sort(key=score, reverse=True)
    if focus is not None:  # the verdict's module always leads the table
        lead = [r for r in rows.values() if r.module == focus and r.kind == "activation"]
        interesting = lead + [r for r in interesting if r not in lead]
    return interesting[:limit]


def _module_flush(st: StepStats, ref: StepStats) -> dict[str, tuple[float, list[tuple[str, float]]]]:
    """Per module with parameters: the share of its own parameters' FP32-non-zero gradient elements that are zero in
    ``st`` (flushed), and each parameter's share; rows with a non-finite value in either stage are left out."""
    acc: dict[str, list[Any]] = {}
    for p, row in st.pgrad.items():
        r = ref.pgrad.get(p)
        if r is None or nonfinite(row) > 0 or nonfinite(r) > 0 or not row[Col.NUMEL]:
            continue
        live = float(row[Col.NUMEL] - r[Col.ZERO])  # FP32-non-zero elements
        if live <= 0:
            continue
        frac = locate.flushed_frac(row, r)
        a = acc.setdefault(p.rsplit(".", 1)[0] if "." in p else locate.MODEL, [0.0, 0.0, []])
        a[0] += frac * live
        a[1] += live
        a[2].append((p, frac))
    return {m: (a[0] / a[1], a[2]) for m, a in acc.items()}


def first_flushed_module(target: StageResult, fp32: StageResult) -> tuple[int, str, float, list[tuple[str, float]]] | None:
    """(step, module, flushed share, its parameters' shares): the first step at which a module's own parameter
    gradients are more than half flushed (non-zero in FP32 on the same step, zero in the target), and of those modules
    the first that backward reaches on that step."""
    for st in target.stats:
        ref = _stats_at(fp32, st.step)
        if ref is None:
            continue
        flushed = {m: v for m, v in _module_flush(st, ref).items() if v[0] > FLUSH_THRESHOLD}
        if flushed:
            rank = {m: i for i, m in enumerate(locate.backward_order(st))}
            m = min(flushed, key=lambda n: rank.get(n, 1 << 30))
            share, params = flushed[m]
            return st.step, m, share, sorted(params, key=lambda pv: -pv[1])
    return None


def hit_modules(target: StageResult, fp32: StageResult, step: int) -> int:
    """How many modules have more than half of their parameter gradients flushed at ``step``."""
    st, ref = _stats_at(target, step), _stats_at(fp32, step)
    if st is None or ref is None:
        return 0
    return sum(1 for v in _module_flush(st, ref).values() if v[0] > FLUSH_THRESHOLD)


def module_grad_absmax(st: StepStats, module: str) -> float | None:
    """The largest |gradient| of the module's parameters in a step's statistics (None if none recorded)."""
    vals = [float(row[Col.ABSMAX]) for name, row in st.pgrad.items()
            if name == module or name.startswith(module + ".") or (module == locate.MODEL and "." not in name)]
    vals = [v for v in vals if math.isfinite(v)]
    return max(vals) if vals else None


def calibration_steps(res: StageResult) -> list[int]:
    """Skipped steps that brought GradScaler's scale to a new low (see scaler.diagnose_scale)."""
    scales = [float(r.scaler_scale or 0.0) for r in res.records]
    return [i for i, r in enumerate(res.records) if r.skipped and (i == 0 or scales[i] <= min(scales[:i]))]


def outlier_field(batches: Batches, step: int) -> tuple[str, float, list[int]] | None:
    index = batches.index(step)
    for name, _ in fields(batches[step]):  # the cached ratio first; the samples only for an outlier
        if absmax_ratio(batches, name, index) >= OUTLIER_RATIO:
            r, samples = outlier_ratio(batches, name, index)
            return name, r, samples
    return None


def module_absmax(st: StepStats, module: str) -> float | None:
    vals = [float(st.act[t][Col.ABSMAX]) for c in st.calls if c.module == module for t in c.outputs if t in st.act]
    return max(vals) if vals else None


def probe_grad_problem(probe: StageResult) -> bool:
    """Raw FP16 shows non-finite values in forward or backward (without a scaler hiding them)."""
    for r, st in zip(probe.records, probe.stats, strict=False):
        if not math.isfinite(r.loss) or not math.isfinite(r.grad_l2_pre_clip) or locate.backward_fault(st) or locate.forward_fault(st):
            return True
    return probe.error is not None


def mean_swallowed(res: StageResult) -> float:
    v = [r.update_swallowed_frac for r in res.records if r.update_swallowed_frac is not None]
    return float(np.mean(v)) if v else 0.0
