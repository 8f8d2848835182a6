"""The autocast op policy a triage followed, in its report: the note that says CUDA's policy was emulated on
the CPU (in place of the CPU-autocast note) and ``config.autocast_policy`` (``engine.autocast_policy``'s facts;
the sentence is ``report.words.policy``')."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ampdoctor.report.model import Report
from ampdoctor.report.words import policy as words
from ampdoctor.report.words import stages as stage_words


def apply(report: Report, facts: Mapping[str, Any]) -> None:
    """Say the policy in ``report``: under ``native`` nothing changes (the default leaves no trace in the config);
    under ``cuda`` the CPU-autocast note gives way to what the emulation did."""
    if facts.get("policy") != "cuda":
        if report.config.get("autocast_policy") == "auto":
            report.config.pop("autocast_policy")
        return
    report.config["autocast_policy"] = "cuda"
    report.config["autocast_policy_reason"] = facts.get("reason")
    note = words.cuda_policy(facts)
    if stage_words.CPU_AUTOCAST in report.notes:
        report.notes[report.notes.index(stage_words.CPU_AUTOCAST)] = note
    else:
        report.notes.append(note)


__all__ = ["apply"]
