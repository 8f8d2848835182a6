"""The whole diagnosis in words (``write``): the verdict, its findings (the deciding rule's from its facts, every
other from its code and evidence), the fix sentences and GradScaler's story. It runs when the Report is built,
after a replay's steps were shifted to the run's own numbers, so every step in every sentence is the run's."""

from __future__ import annotations

from dataclasses import replace

from ampdoctor.judge.rules import Diagnosis
from ampdoctor.records import Finding, ScalerStory, Verdict
from ampdoctor.report.words import scaler as scaler_words
from ampdoctor.report.words.evidence import OP_PLACES
from ampdoctor.report.words.findings import FINDINGS, SCALER_NOTES
from ampdoctor.report.words.fixes import fix_text
from ampdoctor.report.words.verdicts import RULE_TITLES, rule_fix, summary


def write(d: Diagnosis) -> tuple[Verdict, list[Finding], list[str], ScalerStory | None]:
    """The verdict, findings, fix sentences and scaler story of a diagnosis, with their words written.

    The deciding rule's finding (the first, unless the verdict is healthy) is worded from the
    outcome's facts; every other finding from its code and evidence.
    """
    o = d.outcome
    variant = str(o.facts["variant"])
    verdict = Verdict(o.cause, o.module, o.step, o.stage, summary(o.facts), d.device)
    scaler = d.scaler
    if scaler is not None and d.scaler_note is not None:
        scaler = replace(scaler, explanation=SCALER_NOTES[d.scaler_note](scaler))
    elif scaler is not None and d.scale is not None:
        scaler = replace(scaler, explanation=scaler_words.story(d.scale))
    findings = []
    for i, f in enumerate(o.findings):
        if i == 0 and variant in RULE_TITLES:
            title, fix = RULE_TITLES[variant](o.facts), rule_fix(variant, o.facts, o.fixes)
        else:
            title, fix = FINDINGS[f.code](f, scaler)
        ev = {k: OP_PLACES.get(v, v) if k == "op_in" else v for k, v in f.evidence.items() if not k.startswith("_")}
        findings.append(replace(f, title=title, fix=fix, evidence=ev))
    return verdict, findings, [fix_text(fx) for fx in o.fixes], scaler
