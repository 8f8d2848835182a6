"""Extra report data built from the stages' per-step statistics (pure functions, no I/O).

``layer_steps`` gives the cells of the layers × steps heatmap: for the most telling modules and
parameters, per step of the target stage, the share of values that overflow or underflow when the
FP32 stage's values are cast to FP16, the share that is NaN/Inf in the target stage, and the share
the target stage flushed to zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import numpy as np

from ampdoctor.formats import FP16
from ampdoctor.judge import locate
from ampdoctor.judge.rules import Diagnosis
from ampdoctor.lint import BY_CODE, LintFinding
from ampdoctor.records import NCOLS, Col, StageResult, StepStats
from ampdoctor.report.model import CodeFinding, Finding, LayerStep, Report, ScalerStory, StageSummary, Verdict
from ampdoctor.report.words import diagnosis as diagnosis_words
from ampdoctor.report.words import run as run_words

Key = tuple[str, str]
"""(module or parameter name, kind)"""

_SUM = (Col.NUMEL, Col.ZERO, Col.UNDERFLOW, Col.SUBNORMAL, Col.NORMAL, Col.OVERFLOW, Col.POSINF, Col.NEGINF, Col.NAN)


def _merge(into: dict[Key, np.ndarray], key: Key, row: np.ndarray) -> None:
    """Add the counts of ``row`` to ``into[key]`` (a module called twice in a step counts twice)."""
    acc = into.get(key)
    if acc is None:
        into[key] = np.array(row, dtype=np.float64, copy=True)
        return
    for c in _SUM:
        acc[c] += row[c]
    acc[Col.ABSMAX] = max(acc[Col.ABSMAX], row[Col.ABSMAX])
    acc[Col.MIN_NONZERO] = min(acc[Col.MIN_NONZERO], row[Col.MIN_NONZERO])


def step_rows(st: StepStats) -> dict[Key, np.ndarray]:
    """One stats row per (module, kind) for a step: module outputs, gradients at them, parameter gradients."""
    out: dict[Key, np.ndarray] = {}
    for c in st.calls:
        for t in c.outputs:
            r = st.act.get(t)
            if r is not None and len(r) == NCOLS and r[Col.NUMEL]:
                _merge(out, (c.module, "activation"), r)
            g = st.grad.get(t)
            if g is not None and len(g) == NCOLS and g[Col.NUMEL]:
                _merge(out, (c.module, "grad"), g)
    for p, r in st.pgrad.items():
        if r[Col.NUMEL]:
            _merge(out, (p, "param_grad"), r)
    return out


def _fractions(keys: list[Key], rows_r: dict[Key, np.ndarray], rows_t: dict[Key, np.ndarray]) -> list[tuple[Key, dict[str, float]]]:
    """Every key's cell fractions for one step, in one pass of array arithmetic (the FP32 reference
    rows ``rows_r`` and the target's ``rows_t``; a key the target lacks has no non-finite and no flush)."""
    r = np.stack([rows_r[k] for k in keys])
    have = np.array([k in rows_t for k in keys])
    t = np.stack([rows_t.get(k, rows_r[k]) for k in keys])
    n_r, n_t = r[:, Col.NUMEL], t[:, Col.NUMEL]
    with np.errstate(divide="ignore", invalid="ignore"):
        over = np.where(n_r > 0, r[:, Col.OVERFLOW] / n_r, 0.0)
        under = np.where(n_r > 0, r[:, Col.UNDERFLOW] / n_r, 0.0)
        nonfin = np.where(have & (n_t > 0), (t[:, Col.POSINF] + t[:, Col.NEGINF] + t[:, Col.NAN]) / n_t, 0.0)
        zr = np.where(n_r > 0, r[:, Col.ZERO] / n_r, 0.0)
        zt = np.where(n_t > 0, t[:, Col.ZERO] / n_t, 0.0)
        flushed = np.where(zr >= 1.0, 0.0, np.maximum(0.0, (zt - zr) / (1.0 - zr)))  # locate.flushed_frac
    flushed = np.where(have & (n_t == n_r), flushed, 0.0)
    absmax = r[:, Col.ABSMAX]
    return [(k, {"overflow_frac": float(over[i]), "underflow_frac": float(under[i]), "nonfinite_frac": float(nonfin[i]),
                 "flushed_frac": float(flushed[i]), "absmax_fp32": float(absmax[i])}) for i, k in enumerate(keys)]


def layer_steps(results: dict[str, StageResult], target: str, *, limit: int = 16,
                include: Iterable[str] = ()) -> list[LayerStep]:
    """Heatmap cells for at most ``limit`` (module, kind) pairs over the target stage's recorded steps.

    Pairs are chosen by what went wrong (non-finite, then overflow, flushed, underflow, then the
    least headroom); names in ``include`` (e.g. the verdict's module) are always kept. Activations
    and their gradients are reported for leaf-most modules only (a container repeats its last
    child). Rows come in forward order, then parameters, each with steps ascending.
    """
    fp32, tgt = results.get("fp32"), results.get(target)
    if fp32 is None or tgt is None or not tgt.stats or not fp32.stats:
        return []
    ref_by_step = {st.step: st for st in fp32.stats}
    cells: dict[Key, dict[int, LayerStep]] = {}
    order: dict[Key, int] = {}
    for st in tgt.stats:
        ref = ref_by_step.get(st.step)
        if ref is None:
            continue
        rows_t, rows_r = step_rows(st), step_rows(ref)
        if not rows_r:
            continue
        keys = list(rows_r)
        for fr in _fractions(keys, rows_r, rows_t):
            key, cell_fr = fr
            order.setdefault(key, len(order))
            cells.setdefault(key, {})[st.step] = LayerStep(module=key[0], kind=key[1], step=st.step, **cell_fr)
    if not cells:
        return []
    leaves = set(locate.innermost(m for m, k in cells if k != "param_grad"))
    keep_always = set(include)
    candidates = [k for k in cells if k[1] == "param_grad" or k[0] in leaves or k[0] in keep_always]

    def score(key: Key) -> tuple[float, ...]:
        cs = cells[key].values()
        absmax = max(c.absmax_fp32 for c in cs)
        return (
            key[0] in keep_always,
            max(c.nonfinite_frac for c in cs) > 0,
            max(c.overflow_frac for c in cs),
            max(c.flushed_frac for c in cs),
            max(c.underflow_frac for c in cs),
            -FP16.headroom_binades(absmax) if absmax > 0 else -math.inf,
        )

    chosen = sorted(candidates, key=score, reverse=True)[: max(0, limit)]
    chosen.sort(key=lambda k: (k[1] == "param_grad", order[k]))
    return [cells[k][s] for k in chosen for s in sorted(cells[k])]


def enrich(report: Report, results: dict[str, StageResult]) -> Report:
    """Fill ``report.layer_steps`` from the stages' statistics when it is empty (idempotent)."""
    if not report.layer_steps:
        target = str(report.config.get("target") or "amp")
        include = [m for m in (report.verdict.first_module, *(r.module for r in report.layers)) if m]
        report.layer_steps = layer_steps(results, target, include=include)
    return report


def stage_summary(res: StageResult, fp32: StageResult | None, step0: int = 0) -> StageSummary:
    """A stage's line of the report, every step the run's own (a replay's or a resumed run's step k is the run's
    step ``step0 + k``): the steps are facts, and the sentence of a stage that stopped is written from its step."""
    recs = res.records
    fp32_loss = None
    if fp32 is not None and fp32.records and recs:
        fp32_loss = fp32.records[min(len(fp32.records), len(recs)) - 1].loss  # same step, same batch
    first_bad = res.first_nonfinite_step
    return StageSummary(
        name=res.name,
        steps_run=len(recs),
        first_nonfinite_step=None if first_bad is None else first_bad + step0,
        skipped_steps=[k + step0 for k in res.skipped_steps],
        final_scale=recs[-1].scaler_scale if recs and recs[-1].scaler_scale is not None else None,
        final_loss=recs[-1].loss if recs else None,
        fp32_loss=fp32_loss,
        losses=[r.loss for r in recs],
        scales=[r.scaler_scale for r in recs],
        grad_norms=[r.grad_l2_pre_clip for r in recs],
        error=asdict(res.error) if res.error else None,
        stopped=_stopped(res, step0),
        master_weights=res.master_weights,
    )


def _stopped(res: StageResult, step0: int) -> str | None:
    """Why the stage stopped early: the step it stopped at is its last record's (the stage breaks right after it),
    the weights when that step left them non-finite, else its loss (a stage without GradScaler)."""
    if res.stopped is None or not res.records:
        return res.stopped
    last = res.records[-1]
    return run_words.stage_stopped("loss" if last.params_finite else "weights", last.step + step0)


def shift_steps(report: Report, offset: int, *, judged: bool = True) -> Report:
    """Number every step as the run did: a replay's step k is the run's step ``offset + k``.

    ``judged=False``: the verdict and findings already carry the run's steps (``rules.shift_diagnosis``
    shifted them before their words were written); shift the rest only. The stages are not shifted here:
    ``stage_summary`` builds them in the run's steps.
    """
    if offset == 0:
        return report
    v = report.verdict
    if judged and v.first_step is not None:
        v.first_step += offset
    for f in report.findings if judged else []:
        if f.step is not None:
            f.step += offset
    for row in report.layers:
        if row.first_nonfinite_step is not None:
            row.first_nonfinite_step += offset
    if judged and report.scaler is not None:  # else the story was told in the run's steps (context.scaler_story)
        for e in report.scaler.skips:
            e.step += offset
    for ls in report.layer_steps:
        ls.step += offset
    return report


def code_findings(found: Iterable[LintFinding], cause: str) -> list[CodeFinding]:
    """The lint's findings for the report: those whose rule can cause the verdict first, then by place."""
    out = [CodeFinding(f.path, f.line, f.col, f.code, f.message, BY_CODE[f.code].fix, cause in BY_CODE[f.code].explains)
           for f in found]
    return sorted(out, key=lambda c: (not c.explains, c.path, c.line, c.col, c.code))


def worded(diag: Diagnosis) -> tuple[Verdict, list[Finding], list[str], ScalerStory | None]:
    """The diagnosis in words: the verdict, the findings, the fixes and GradScaler's story (``diagnosis_words.write``)."""
    return diagnosis_words.write(diag)


def replayed_scaler(story: ScalerStory, amp: StageResult | None, steps: int, manifest: dict[str, Any]) -> None:
    """GradScaler's story of a replay: its few steps are no scale history (the run's own is in its step log). The
    scale it started from is the captured one, already proven, so a skip in the replay is no calibration."""
    story.pattern = "replay"
    first = next((r.scaler_scale for r in amp.records if r.scaler_scale is not None), None) if amp is not None else None
    if first is not None:  # the captured scale, not the spec's default
        story.init_scale = first
    story.calibration_skips = 0
    story.explanation = run_words.replay_scaler(story.init_scale, steps, manifest)
