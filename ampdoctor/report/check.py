"""``ampdoctor check``'s report: the series of checkpoints judged (``judge.checkpoint_health``), as plain data
with its words, built once; ``render.check`` draws it (terminal table, JSON)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ampdoctor.formats import Format
from ampdoctor.input.checkpoint_series import Loaded
from ampdoctor.judge.checkpoint_health import Health, Issue, judge, judge_series
from ampdoctor.report.words import check as words

MAX_MODULES = 12
"""Modules listed under a damaged checkpoint in the terminal (``--json`` has every one)."""


@dataclass
class CheckedCheckpoint:
    """One checkpoint: its state ('good', 'damaged', 'unreadable'), what is wrong by module, in words and figures."""

    path: str
    step: int | None
    status: str
    summary: str
    layout: str = ""
    modules: list[tuple[str, list[str]]] = field(default_factory=list)
    """(module, one line per damaged tensor) for every damaged module, in the checkpoint's order."""
    issues: list[dict[str, Any]] = field(default_factory=list)
    """Every damaged tensor's code and figures (``judge.checkpoint_health.Issue``)."""
    scale: float | None = None
    notes: list[str] = field(default_factory=list)
    error: str = ""
    """Why it could not be read (unreadable), in one line."""


@dataclass
class CheckReport:
    target: str
    checkpoints: list[CheckedCheckpoint]
    verdict: str
    first_damaged: str | None
    last_good: str | None
    exit_code: int
    """0: every checkpoint healthy; 1: damage found; 2: none damaged but one could not be read."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for c in d["checkpoints"]:
            c["modules"] = [{"module": m, "damage": lines} for m, lines in c["modules"]]
            for i in c["issues"]:
                i["value"] = _json_number(i["value"])
            c["scale"] = _json_number(c["scale"]) if c["scale"] is not None else None
        d["schema"] = "ampdoctor-check/1"
        return d


def _json_number(x: float) -> Any:
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else "inf" if x > 0 else "-inf")


def _name_in(module: str, name: str) -> str:
    return name[len(module) + 1:] if module and name.startswith(module + ".") else name


def _worded(h: Health, fmt: Format) -> tuple[str, list[tuple[str, list[str]]]]:
    codes: dict[str, tuple[int, set[str]]] = {}
    for i in h.issues:
        n, mods = codes.get(i.code, (0, set()))
        codes[i.code] = (n + 1, mods | {i.module})
    by_mod = h.by_module()
    modules = [m for m in by_mod if m]
    lines: list[tuple[str, list[str]]] = []
    for m, issues in by_mod.items():
        lines.append((m or "GradScaler", _lines(m, issues, fmt)))
    return words.summary(codes, fmt.name, modules), lines


def _lines(module: str, issues: list[Issue], fmt: Format) -> list[str]:
    """One line per tensor name: its NaN/Inf parts together, then each other finding."""
    by_name: dict[str, list[Issue]] = {}
    for i in issues:
        by_name.setdefault(i.name, []).append(i)
    out = []
    for name, its in by_name.items():
        bad = [(i.part, i.count, i.numel) for i in its if i.code == "nonfinite"]
        texts = [words.nonfinite_parts(bad)] if bad else []
        texts += [words.issue(i.code, i.part, i.count, i.numel, i.value, i.dtype, fmt.name) for i in its if i.code != "nonfinite"]
        label = _name_in(module, name)
        out += [f"{label}: {t}" if label else t for t in texts]
    return out


def _judged(c: Loaded, fmt: Format) -> tuple[CheckedCheckpoint, Health | None]:
    """The checkpoint's row (its words come later, once its neighbours have been judged) and its health."""
    if c.state is None:
        why = c.error
        for pre in (f"{c.path}: ", f"{c.path}/: ", f"{c.path.name}/: "):
            why = why[len(pre):] if why.startswith(pre) else why
        return CheckedCheckpoint(str(c.path), c.step, "unreadable", why, error=c.error), None
    h = judge(c.state, fmt)
    notes = list(c.state.notes) + ([f"optimizer entries matched to weights {h.names_how}"] if h.names_how else [])
    return CheckedCheckpoint(str(c.path), c.step, "", "", c.state.layout, scale=h.scale, notes=notes), h


def _word(row: CheckedCheckpoint, h: Health, fmt: Format) -> None:
    row.status = "damaged" if h.damaged else "good"
    if not h.damaged:
        row.summary = words.healthy(h.tensors, fmt.name, h.adam, h.scale)
        return
    row.summary, row.modules = _worded(h, fmt)
    row.issues = [dict(asdict(i), module=i.module) for i in h.issues]


def build(series: Iterable[Loaded], fmt: Format) -> CheckReport:
    """Judge each checkpoint as it is read (then let it go), sort by step, add what neighbours tell
    (``judge_series``: the scale's fall from the first, Adam's v below its previous), and say the verdict."""
    judged: list[tuple[int, int, CheckedCheckpoint, Health | None]] = []
    for c in series:
        row, h = _judged(c, fmt)
        judged.append((c.step if c.step is not None else -1, c.order, row, h))
        c.state = None
    judged.sort(key=lambda t: (t[0], t[1]))
    judge_series([h for *_, h in judged])
    for *_, row, h in judged:
        if h is not None:
            _word(row, h, fmt)
    rows = [row for *_, row, _ in judged]
    first = next((r for r in rows if r.status == "damaged"), None)
    before = rows[:rows.index(first)] if first is not None else rows
    last_good = next((r.path for r in reversed(before) if r.status == "good"), None)
    after = [r.path for r in rows[rows.index(first) + 1:] if r.status == "good"] if first is not None else []
    unreadable = sum(r.status == "unreadable" for r in rows)
    verdict = words.series(len(rows), first.path if first else None, first.step if first else None,
                           last_good if first else None, after, unreadable)
    code = 1 if first is not None else 2 if unreadable else 0
    return CheckReport(fmt.name, rows, verdict, first.path if first else None, last_good if first else None, code)


__all__ = ["MAX_MODULES", "CheckReport", "CheckedCheckpoint", "build"]
