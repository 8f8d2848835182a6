"""Findings that stand on their evidence, by code (``FINDINGS``): warnings and the data scan's issues
(``data_issue``), and the notes that replace the scale history's own explanation where the verdict knows better
(``SCALER_NOTES``)."""

from __future__ import annotations

from collections.abc import Callable

from ampdoctor.fmt import fixed, gen, pct0, pow2
from ampdoctor.formats import FP16
from ampdoctor.records import Finding, ScalerStory
from ampdoctor.report.words.common import Facts, g3, g4

_DATA_WORDS = {"nonfinite": "NaN/Inf", "sentinel": "a repeated sentinel value", "outlier": "an outlier",
               "beyond_fp16": "values beyond FP16's range"}


def data_issue(d: Facts) -> str:
    """One data-scan issue (``rules._issue_facts``) in words (a value beyond FP16's range says so)."""
    s = _data_issue(d)
    if d.get("beyond_fp16") and d["kind"] != "beyond_fp16":
        s += f"; beyond FP16's max {gen(FP16.max)}: FP16 cannot represent it (cast to FP16 it is inf)"
    return s


def _data_issue(d: Facts) -> str:
    b, field, samples = d["batch"], d["field"], d["samples"]
    if d["kind"] == "nonfinite":
        return f"batch {b} holds {d['count']} NaN/Inf value(s) in {field} (samples {samples})"
    if d["kind"] == "sentinel":
        return (f"{field} holds the constant {gen(d['value'])} {d['count']} time(s) in {d['batches']} batch(es) (first: batch "
                f"{b}, samples {samples}), {g3(d['ratio'])}x its typical magnitude {g3(d['typical'])}: a fill value, "
                "not a measurement")
    if d["kind"] == "outlier":
        return (f"batch {b} holds an outlier: {field} reaches {g4(d['value'])} in samples {samples}, "
                f"{g3(d['ratio'])}x its typical magnitude {g3(d['typical'])}")
    return f"batch {b} holds {field} values up to {g4(d['value'])} (samples {samples}), beyond FP16's max {gen(FP16.max)}"


def _data_fix(d: Facts) -> str:
    if d["kind"] == "sentinel":
        return f"Drop or fix these rows in build_dataloader() (e.g. mask {gen(d['value'])} as missing)"
    if d["kind"] == "nonfinite":
        return "Filter them in build_dataloader() (keep rows where torch.isfinite(x).all())"
    return "Normalise this field (or clip it) in build_dataloader(); check the source of these samples"


def _probe_follows(f: Finding) -> str:
    ev, issue = f.evidence, f.evidence["_issue"]
    return (f"raw FP16 first fails at step {f.step}, on batch {ev['batch']}, which holds {_DATA_WORDS[issue['kind']]} "
            f"that no earlier batch holds: the failure follows the data ({data_issue(issue)})")


FindingWords = Callable[[Finding, ScalerStory | None], tuple[str, str]]


FINDINGS: dict[str, FindingWords] = {
    "scaler_normal": lambda f, s: (
        f"GradScaler skipped step {f.step} at scale {gen(f.evidence['scale']) if f.evidence.get('scale') else '?'} "
        f"({str(f.evidence.get('phase', '')).replace('_', ' ')}) and backed off: its normal working",
        "Nothing to change. Monitor(capture_on='failure'), the default, does not capture these skips."),
    "calibration_skips": lambda f, s: (
        f"{f.evidence['_count']} GradScaler skip(s) while the scale calibrated from {gen(f.evidence['_init_scale'])}",
        s.explanation if s is not None else ""),
    "fp16_grad_underflow": lambda f, s: (
        f"{f.evidence['_count']} parameter gradient(s) flush to zero in {f.stage} without stalling training",
        "Watch these layers; bf16 or keeping them in FP32 removes the flush."),
    "probe_underflow": lambda f, s: (
        f"raw FP16 without scaling flushes {f.evidence['_count']} parameter gradient(s) to zero; GradScaler cures it",
        "Keep GradScaler on; never train this model in FP16 without loss scaling."),
    "probe_nonfinite": lambda f, s: (
        f"raw FP16 without scaling goes non-finite at step {f.step}; the target configuration avoids it",
        "Keep autocast and GradScaler; do not train with model.half()."),
    "probe_swallowed": lambda f, s: (
        f"{pct0(f.evidence['lost_update_share'])} of the FP32 updates would be lost with FP16 weights",
        "Keep FP32 master weights (autocast does)."),
    "thin_headroom": lambda f, s: (
        f"{f.module} reaches {g4(f.evidence['absmax'])}, {fixed(f.evidence['headroom_binades'])} binades below FP16's max",
        f"Fine now; if it keeps growing, keep {f.module} in FP32 or use bf16."),
    **{f"data_{k}": (lambda f, s: (data_issue(f.evidence["_issue"]), _data_fix(f.evidence["_issue"]))) for k in _DATA_WORDS},
    "probe_follows_data": lambda f, s: (_probe_follows(f), f"Fix batch {f.evidence['batch']} first; then rerun triage."),
}
"""Finding code → (title, fix) for findings that are not the deciding rule's own."""


def _forward_fault(sc: ScalerStory) -> str:
    """The skips of a run whose forward pass overflows: how many the forward made, and what they did to the scale."""
    n = len(sc.skips)
    fwd = sum(1 for e in sc.skips if e.reason == "nonfinite_loss")
    fell = f"from {pow2(sc.init_scale)} to {pow2(sc.min_scale)}"
    if not fwd or fwd == n:
        return (f"{n} skip(s) follow the non-finite values the forward pass makes (see the verdict), not calibration: "
                f"no loss scale changes a forward value, yet GradScaler halves its scale at each, so the scale fell {fell}.")
    grad = [e for e in sc.skips if e.reason != "nonfinite_loss"]
    # a skip on a non-finite loss is never calibration (judge.scaler.diagnose_scale), so the calibration skips are
    # gradient overflows: all of them are calibration when there are as many
    calibrating = len(grad) <= sc.calibration_skips
    rest = (f"The other {len(grad)} are gradient overflows while the scale came down from {pow2(sc.init_scale)}: "
            "GradScaler calibrating, as designed. The gradients are not the problem: fix the forward pass."
            if calibrating else
            f"The other {len(grad)} are gradient overflows, at steps {', '.join(str(e.step) for e in grad[:10])}.")
    return (f"{fwd} of the {n} skips follow a non-finite loss, the forward overflow the verdict names, not calibration: "
            "no loss scale changes a forward value, yet GradScaler halves its scale at each one, so the scale fell "
            f"{fell}. " + rest)


SCALER_NOTES: dict[str, Callable[[ScalerStory], str]] = {
    "overflows_hidden": lambda sc: (
        "The scale never backed off, but not because the gradients fit: the overflows were hidden from GradScaler "
        "before unscale_ (see the verdict)."),
    "forward_fault": _forward_fault,
}
"""A note that replaces the scale history's own explanation, where the verdict knows better."""


from ampdoctor.report.words import compile as _compile  # noqa: E402 - the compile rung's words, merged in

FINDINGS.update(_compile.FINDINGS)
