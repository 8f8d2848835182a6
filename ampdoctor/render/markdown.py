"""The Markdown report (GitHub-flavoured): made to be pasted into an issue or a ticket.

Verdict first, then what to change, the stage table, the offending layers, the GradScaler story,
plots (PNG files beside the Markdown file, linked relatively), warnings, how to reproduce and the
environment. Long tables fold into ``<details>``.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ampdoctor.fmt import command
from ampdoctor.render.common import (
    CAUSE_TITLES,
    calibration_line,
    history,
    listed,
    num,
    option_value,
    pct,
    ran_steps,
    reason_label,
    scale,
    scaled_stage,
    skip_reasons,
    spec_name,
    step0,
    steps,
)
from ampdoctor.report.model import Report, StageSummary
from ampdoctor.report.words import evidence as evidence_words
from ampdoctor.report.words import run as run_words

SHOW_ROWS = 6
"""Rows of a long table shown before the rest folds into <details>."""

ENV_KEYS = (
    ("ampdoctor", "ampdoctor"), ("torch", "torch"), ("python", "Python"), ("cuda", "CUDA"), ("device", "device"),
    ("device_name", "device name"), ("compute_capability", "compute capability"), ("fp16_supported", "FP16 supported"),
    ("bf16_supported", "BF16 supported"), ("tf32_matmul", "TF32 matmul"), ("tf32_cudnn", "TF32 cuDNN"), ("os", "OS"),
)

_OPTIONS = (("steps", "--steps"), ("target", "--target"), ("seed", "--seed"), ("device", "--device"),
            ("max_norm", "--max-norm"), ("init_scale", "--init-scale"), ("growth_interval", "--growth-interval"),
            ("backoff_factor", "--backoff-factor"))


def reproduce_command(report: Report) -> str | None:
    """The triage command with every option that shapes the run spelled out (seed included)."""
    cfg = report.config
    parts = command("triage", cfg, _OPTIONS, report.environment.get("device"))
    if parts is None:
        return None
    if cfg.get("stages"):
        parts += ["--stages", shlex.quote(option_value(cfg["stages"]))]
    if (cfg.get("accumulate") or 1) > 1:
        parts += ["--accumulate", str(cfg["accumulate"])]
    # where the stages started: a capture, or a checkpoint and the batches skipped to reach it
    for key, flag in (("from_capture", "--from"), ("checkpoint", "--checkpoint")):
        if cfg.get(key):
            parts += [flag, shlex.quote(str(cfg[key]))]
    if cfg.get("skip_batches"):
        parts += ["--skip-batches", str(cfg["skip_batches"])]
    if cfg.get("script"):
        parts += ["--script", shlex.quote(str(cfg["script"]))]
    return " ".join(parts)


_CODE_SPAN = re.compile(r"(`[^`\n]*`|\[[^\]\n]*\]\(#[\w-]*\))")
"""Left as they are: code spans, and the in-page links the renderers make themselves ([bf16](#bf16))."""
_MD_SPECIAL = re.compile(r"([\\<>*\[\]]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
"""Markdown's specials; an underscore inside a word (c_attn) is literal on GitHub and stays bare."""


def text(x: Any) -> str:
    """Free text for Markdown: outside `code spans` (and in-page links), the characters Markdown or GitHub's HTML filter would
    eat are backslash-escaped (``<model>`` stays visible, ``c_attn`` keeps its underscore, ``[0]`` is no link)."""
    parts = _CODE_SPAN.split(str(x))
    return "".join(p if i % 2 else _MD_SPECIAL.sub(r"\\\1", p) for i, p in enumerate(parts))


def cell(x: Any) -> str:
    """A table cell (or any inline text): Markdown escaped outside code spans, pipes escaped, newlines folded."""
    return text(x).replace("|", "\\|").replace("\n", " ")


def code(x: Any) -> str:
    return f"`{x}`" if x not in (None, "") else "-"


def table(head: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    right = right or set()
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i in right else "---" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return out


def folded(head: list[str], rows: list[list[str]], what: str, right: set[int] | None = None) -> list[str]:
    """The first SHOW_ROWS rows as a table; all rows inside <details> when there are more."""
    if len(rows) <= SHOW_ROWS:
        return table(head, rows, right)
    return [*table(head, rows[:SHOW_ROWS], right), "", f"<details><summary>All {len(rows)} {what}</summary>", "",
            *table(head, rows, right), "", "</details>"]


def _stage_note(s: StageSummary) -> str:
    if s.error:
        return f"{s.error.get('type')} at step {s.error.get('step')}: {s.error.get('message', '')}"
    if s.stopped:
        return s.stopped
    if s.name == "fp16":
        return "FP32 master weights" if s.master_weights else "FP16 weights + optimizer"
    return ""


def _headroom(h: float) -> str:
    return "inf" if math.isinf(h) else f"{h:.1f}"


def _verdict(report: Report) -> list[str]:
    v = report.verdict
    title = CAUSE_TITLES.get(v.cause, v.cause)
    icon = "✅" if v.cause == "healthy" else "❓" if v.cause in ("inconclusive", "not_reproduced", "replay_mismatch") else "❌"
    step_label = "First bad batch" if v.cause == "data" else "First bad step"
    name = spec_name(report)
    lines = [f"# {title}" + (f" in {text(name)}" if name else ""), "",
             text(run_words.what_ran(report.tool, report.config, ran_steps(report))), "",
             f"> {icon} **Verdict: {title}** (`{v.cause}`)", ">", f"> {text(v.summary)}", ""]
    lines += table(["First module", step_label, "Stage", "Device", "Spec"],
                   [[code(v.first_module), num(v.first_step), v.stage or "-", v.device, code(report.config.get("spec"))]])
    return lines


def _code(report: Report) -> list[str]:
    """'## In the code': what ``ampdoctor lint`` found in the spec and --script, under the verdict."""
    if not report.lint:
        return []
    lines = ["", "## In the code", "", "`ampdoctor lint` on the spec" + (" and the training script" if report.config.get("script") else "")
             + " (read, not run):", ""]
    for c in report.lint:
        why = f" (can cause `{report.verdict.cause}`)" if c.explains else ""
        lines += [f"- `{c.path}:{c.line}:{c.col}` **{c.code}** {cell(c.message)}{why}", f"  - fix: {cell(c.fix)}"]
    return lines


def _fixes(report: Report) -> list[str]:
    if not report.fixes:
        return []
    return ["", "## What to change", "", *[f"{i}. {cell(f)}" for i, f in enumerate(report.fixes, 1)]]


def _stages(report: Report) -> list[str]:
    if not report.stages:
        return []
    head = ["stage", "steps", "first non-finite", "skipped", "final scale", "final loss", "FP32 loss", "note"]
    rows = [[s.name, str(s.steps_run), num(s.first_nonfinite_step), str(len(s.skipped_steps)), scale(s.final_scale),
             num(s.final_loss), num(s.fp32_loss) if s.name != "fp32" else "", _stage_note(s)] for s in report.stages]
    start = str(report.config.get("start") or "the initial weights")
    start = "the same initial weights and seed" if start == "the initial weights" else start
    lines = ["", "## Stages", "", f"Every stage replays the same batches from {start}; "
             "*FP32 loss* is FP32's loss at that stage's last step (same batch).", ""]
    lines += table(head, rows, {1, 2, 3, 4, 5, 6})
    return lines


def _layers(report: Report) -> list[str]:
    if not report.layers:
        return []
    head = ["module / parameter", "kind", "absmax FP32", "headroom (binades)", "overflow", "flushed", "non-finite",
            "first bad step"]
    rows = [[code(r.module), r.kind, num(r.absmax_fp32), _headroom(r.headroom_binades), pct(r.overflow_frac),
             pct(r.underflow_frac), pct(r.nonfinite_frac), num(r.first_nonfinite_step)] for r in report.layers]
    lines = ["", "## Offending layers", "", "FP32 values cast to FP16 (absmax, headroom, overflow); flushed and non-finite "
             "shares from the target stage. Headroom below 0 means the values do not fit FP16 (max 65504).", ""]
    lines += folded(head, rows, "layers", {2, 3, 4, 5, 6, 7})
    return lines


def _scale_runs(stage: StageSummary, base: int = 0) -> list[list[str]]:
    """Runs of steps with the same scale: steps (the run's, from ``base``), scale, skipped steps in the run."""
    skipped = set(stage.skipped_steps)
    runs: list[list[Any]] = []
    for i, s in enumerate(stage.scales, start=base):
        if runs and runs[-1][2] == s:
            runs[-1][1] = i
            runs[-1][3] += i in skipped
        else:
            runs.append([i, i, s, int(i in skipped)])
    return [[f"{a}" if a == b else f"{a}-{b}", scale(s), str(k)] for a, b, s, k in runs]


def _scaler(report: Report) -> list[str]:
    sc = report.scaler
    if sc is None:
        return []
    why = skip_reasons(sc.skips, module=code)
    lines = ["", "## GradScaler", "",
             f"**Pattern: {sc.pattern}.** {cell(sc.explanation)}", "",
             f"- scale: init {scale(sc.init_scale)}, final {scale(sc.final_scale)}, min {scale(sc.min_scale)}, "
             f"max {scale(sc.max_scale)}",
             f"- skipped steps ({len(sc.skips)}): {steps([e.step for e in sc.skips])}; why: {why}",
             f"- calibration skips (the scale finding its level at the start): {calibration_line(sc)}"]
    stage = scaled_stage(report)
    if stage is not None:
        lines += ["", *folded(["steps", "scale", "skipped"], _scale_runs(stage, step0(report)), "scale runs", {1, 2})]
    if sc.skips:
        rows = [[str(e.step), scale(e.scale), reason_label(e.reason, module=code) if e.reason else "-"] for e in sc.skips]
        lines += ["", f"<details><summary>Skipped steps and why ({len(rows)})</summary>", "",
                  *table(["step", "scale", "reason"], rows, {0, 1}), "", "</details>"]
    return lines


def _plots(report: Report, images: Mapping[str, str] | None, missing: str | None) -> list[str]:
    """The key pictures as text first (they survive a paste into a ticket), then the PNGs beside the file."""
    from ampdoctor.render.plots import TITLES

    charts = text_charts(report)
    if not charts and not missing and not images:
        return []
    lines = ["", "## Plots", ""]
    if charts:
        lines += ["```text", *charts, "```", ""]
    if missing:
        lines.append(f"_No plots: {missing}._")
    elif images:
        lines += image_lines(images, TITLES)
    return lines if lines[-1] else lines[:-1]


def text_charts(report: Report) -> list[str]:
    """Headroom per layer and the scale over the steps, as Unicode block charts (blank line between)."""
    from ampdoctor.render import textchart
    from ampdoctor.render.plots import headroom_rows, is_culprit

    out: list[str] = []
    rows = sorted(headroom_rows(report), key=lambda r: r[1])
    if rows:
        out += textchart.headroom([(n, h, is_culprit(report, n.rsplit(" [", 1)[0])) for n, h in rows])
    stage = scaled_stage(report)
    if stage is not None:
        v = report.verdict
        hist = textchart.scale_history(stage.scales, stage.skipped_steps, step0(report),
                                       v.first_step if v.cause not in ("healthy", "data") else None)
        out += ([""] if out and hist else []) + hist
    return out


def image_lines(images: Mapping[str, str], titles: Mapping[str, str]) -> list[str]:
    """One relative image link per plot, a blank line between them."""
    lines: list[str] = []
    for name, href in images.items():
        lines += [f"![{titles.get(name, name)}]({href})", ""]
    return lines[:-1]


def _findings(report: Report) -> list[str]:
    errors = [f for f in listed(report) if f.severity == "error"]
    other = [f for f in listed(report) if f.severity != "error"]
    lines: list[str] = []
    told = history(report)
    if told is not None:  # the lookback ring's story of the steps before the failure
        lines += ["", "## Before the failure", "", f"**{cell(told.title)}**", "",
                  *[f"- {cell(x)}" for x in told.evidence.get("lines", [])]]
    if errors:
        lines += ["", "## Evidence", ""]
        for f in errors:
            where = ", ".join(x for x in (f"stage {f.stage}" if f.stage else "", f"module `{f.module}`" if f.module else "",
                                          f"step {f.step}" if f.step is not None else "") if x)
            lines.append(f"- **{cell(f.title)}**" + (f" ({where})" if where else ""))
            if f.evidence:
                lines.append(f"  - evidence: {cell(' '.join(evidence_words.evidence(f.evidence, f.module)))}")
            if f.fix:
                lines.append(f"  - fix: {cell(f.fix)}")
    if other:
        lines += ["", "## Warnings", ""]
        for f in other:
            lines.append(f"- **{f.severity}** `{f.code}`: {cell(f.title)}" + (f" — {cell(f.fix)}" if f.fix else ""))
    if report.notes:
        lines += ["", "## Notes", "", *[f"- {cell(n)}" for n in report.notes]]
    return lines


def _reproduce(report: Report) -> list[str]:
    return reproduce_section(reproduce_command(report), report.environment.get("command"))


def reproduce_section(cmd: str | None, ran: Any) -> list[str]:
    """'## Reproduce': the rebuilt command (every option spelled out) and the command line as typed."""
    if not cmd and not ran:
        return []
    lines = ["", "## Reproduce", ""]
    if cmd:
        lines += ["With every option that shapes the run (same seed, same batches):", "", "```sh", cmd, "```"]
    if ran:
        lines += ["", "The command that made this report:", "", "```sh", str(ran), "```"]
    return lines


def _environment(report: Report) -> list[str]:
    return environment_section(report.environment, report.config)


def environment_section(env: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """'## Environment': versions, device and TF32 flags, then the options (``spec`` left out) folded."""
    if not env:
        return []
    known = {k for k, _ in ENV_KEYS} | {"command"}
    rows = [[label, num(env[k]) if env.get(k) is not None else "-"] for k, label in ENV_KEYS if k in env]
    rows += [[k, num(v)] for k, v in env.items() if k not in known]
    lines = ["", "## Environment", "", *table(["name", "value"], rows)]
    cfg = {k: v for k, v in config.items() if k != "spec"}
    if cfg:
        lines += ["", "<details><summary>Options</summary>", "",
                  *table(["option", "value"], [[k, option_value(v) if v is not None else "-"] for k, v in cfg.items()]),
                  "", "</details>"]
    return lines


def render(report: Report, images: Mapping[str, str] | None = None, *, missing_plots: str | None = None) -> str:
    """The Markdown text. ``images`` maps plot names to (relative) links; ``missing_plots`` says why there are none."""
    lines = [*_verdict(report), *_code(report), *_fixes(report), *_stages(report), *_layers(report), *_scaler(report),
             *_plots(report, images, missing_plots), *_findings(report), *_reproduce(report), *_environment(report),
             "", f"<sub>{report.tool} · report schema {report.schema_version}</sub>", ""]
    return "\n".join(lines)


def assets_dir(path: Path) -> Path:
    """Where the PNGs of ``report.md`` go: ``report_files/`` beside it."""
    return path.with_name(f"{path.stem}_files")


def outputs(report: Report, path: str | Path) -> dict[Path, str | bytes]:
    """Every file of a Markdown report at ``path``: the text and, with matplotlib, the PNGs beside it."""
    from ampdoctor.render import plots

    p = Path(path)
    files: dict[Path, str | bytes] = {}
    if not plots.available():
        files[p] = render(report, missing_plots=plots.INSTALL_HINT)
        return files
    figs = plots.figures(report)
    folder = assets_dir(p)
    links = {}
    for name, png in figs.items():
        files[folder / f"{name}.png"] = png
        links[name] = f"{folder.name}/{name}.png"
    files[p] = render(report, links)
    return files
