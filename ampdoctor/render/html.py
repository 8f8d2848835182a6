"""The HTML report: one self-contained file (inline CSS, plots as base64 data URIs, no scripts, no network)."""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Mapping
from typing import Any

from ampdoctor.render import common
from ampdoctor.render.common import num, pct, scale, steps
from ampdoctor.render.markdown import ENV_KEYS, SHOW_ROWS, _scale_runs, _stage_note, reproduce_command
from ampdoctor.report.model import Report
from ampdoctor.report.words import evidence as evidence_words
from ampdoctor.report.words import run as run_words

CSS = """
body{font:14px/1.45 -apple-system,BlinkMacSystemFont,"Segoe UI",Helvetica,Arial,sans-serif;color:#1f2328;margin:0;background:#f6f8fa}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 12px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.verdict{background:#fff;border:1px solid #d0d7de;border-left:8px solid var(--c);border-radius:6px;padding:14px 18px}
.verdict .cause{font-size:20px;font-weight:600;color:var(--c)}
.facts{display:flex;flex-wrap:wrap;gap:8px 22px;margin-top:10px}.facts b{font-weight:600}
table{border-collapse:collapse;background:#fff;margin:6px 0;font-size:13px}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}td.n{text-align:right;font-variant-numeric:tabular-nums}
th{background:#eef1f4}tr.bad td{background:#ffebe9}tr.warn td{background:#fff8c5}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
pre{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:10px;overflow-x:auto;white-space:pre-wrap}
.plots{display:grid;grid-template-columns:repeat(auto-fit,minmax(460px,1fr));gap:12px}
figure{margin:0;background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px}
figure img{width:100%;height:auto;display:block}figcaption{font-size:12px;color:#57606a;margin-top:4px}
figure.wide{grid-column:1/-1}.plots.two{grid-template-columns:repeat(2,minmax(0,1fr))}
.muted{color:#57606a}ol li,ul li{margin:3px 0}details{margin:6px 0}summary{cursor:pointer;color:#0969da}
"""

_COLOR = {"healthy": "#1a7f37", "inconclusive": "#9a6700", "not_reproduced": "#9a6700", "replay_mismatch": "#9a6700"}


def e(x: Any) -> str:
    return html.escape(str(x), quote=True)


_TICKED = re.compile(r"`([^`\n]+)`")


def t(x: Any) -> str:
    """Prose (the report's words) as HTML: escaped, and what the words quote as code (`torch.autocast(...)`) set as
    code, not printed with its backticks."""
    return _TICKED.sub(r"<code>\1</code>", e(x))


def _table(head: list[str] | None, rows: list[list[str]], right: set[int] | None = None,
           classes: list[str] | None = None) -> str:
    """Cells are already-escaped HTML; ``head`` None: no header row (a table of names and values)."""
    right = right or set()
    out = ["<table>", *(["<thead><tr>", *[f"<th>{h}</th>" for h in head], "</tr></thead>"] if head else []), "<tbody>"]
    for i, r in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(f'<td class="n">{c}</td>' if j in right else f"<td>{c}</td>"
                                          for j, c in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _folded(head: list[str], rows: list[list[str]], what: str, right: set[int] | None = None,
            classes: list[str] | None = None) -> str:
    if len(rows) <= SHOW_ROWS:
        return _table(head, rows, right, classes)
    return (_table(head, rows[:SHOW_ROWS], right, classes[:SHOW_ROWS] if classes else None)
            + f"<details><summary>All {len(rows)} {e(what)}</summary>{_table(head, rows, right, classes)}</details>")


def _verdict(report: Report) -> str:
    v = report.verdict
    title = common.CAUSE_TITLES.get(v.cause, v.cause)
    color = _COLOR.get(v.cause, "#cf222e")
    facts = [("first module", f"<code>{e(v.first_module)}</code>" if v.first_module else "-"),
             ("first bad batch" if v.cause == "data" else "first bad step", e(num(v.first_step))),
             ("stage", e(v.stage or "-")), ("device", e(v.device))]
    fx = "".join(f"<span>{k}: <b>{val}</b></span>" for k, val in facts)
    return (f'<section class="verdict" style="--c:{color}"><div class="cause">{e(title)} '
            f'<code class="muted">{e(v.cause)}</code></div><p>{t(v.summary)}</p><div class="facts">{fx}</div></section>')


def _code(report: Report) -> str:
    """What ``ampdoctor lint`` found in the spec and --script, under the verdict."""
    if not report.lint:
        return ""
    items = []
    for c in report.lint:
        why = f' <span style="color:#cf222e">(can cause <code>{e(report.verdict.cause)}</code>)</span>' if c.explains else ""
        items.append(f"<li><code>{e(c.path)}:{c.line}:{c.col}</code> <b>{e(c.code)}</b> {t(c.message)}{why}"
                     f"<br><span class=\"muted\">fix: {t(c.fix)}</span></li>")
    return "<h2>In the code</h2><p class=\"muted\">ampdoctor lint on the spec" + (
        " and the training script" if report.config.get("script") else "") + ":</p><ul>" + "".join(items) + "</ul>"


def _plots(images: Mapping[str, bytes] | None, missing: str | None) -> str:
    from ampdoctor.render.plots import TITLES

    if missing:
        return f'<h2>Plots</h2><p class="muted">No plots: {e(missing)}.</p>'
    if not images:
        return ""
    figs = [figure(name, png, TITLES.get(name, name), wide=name == "heatmap") for name, png in images.items()]
    return '<h2>Plots</h2><div class="plots">' + "".join(figs) + "</div>"


def figure(name: str, png: bytes, title: str, wide: bool = False) -> str:
    """A plot inline: the PNG as a base64 data: URI, captioned."""
    data = base64.b64encode(png).decode("ascii")
    cls = ' class="wide"' if wide else ""
    return (f'<figure{cls}><img alt="{e(title)}" data-plot="{e(name)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{e(title)}</figcaption></figure>')


def _stages(report: Report) -> str:
    if not report.stages:
        return ""
    head = ["stage", "steps", "first non-finite", "skipped", "final scale", "final loss", "FP32 loss", "note"]
    rows, cls = [], []
    for s in report.stages:
        rows.append([e(s.name), str(s.steps_run), e(num(s.first_nonfinite_step)), str(len(s.skipped_steps)),
                     e(scale(s.final_scale)), e(num(s.final_loss)), e(num(s.fp32_loss)) if s.name != "fp32" else "",
                     e(_stage_note(s))])
        cls.append("bad" if s.error or s.first_nonfinite_step is not None else "warn" if s.skipped_steps else "")
    return "<h2>Stages</h2>" + _table(head, rows, {1, 2, 3, 4, 5, 6}, cls)


def _layers(report: Report) -> str:
    if not report.layers:
        return ""
    head = ["module / parameter", "kind", "absmax FP32", "headroom (binades)", "overflow", "flushed", "non-finite", "first bad step"]
    rows, cls = [], []
    for r in report.layers:
        h = "inf" if math.isinf(r.headroom_binades) else f"{r.headroom_binades:.1f}"
        rows.append([f"<code>{e(r.module)}</code>", e(r.kind), e(num(r.absmax_fp32)), h, e(pct(r.overflow_frac)),
                     e(pct(r.underflow_frac)), e(pct(r.nonfinite_frac)), e(num(r.first_nonfinite_step))])
        cls.append("bad" if r.nonfinite_frac > 0 or r.overflow_frac > 0 else "warn" if r.underflow_frac > 0 else "")
    return ("<h2>Offending layers</h2><p class=\"muted\">FP32 values cast to FP16 (absmax, headroom, overflow); flushed and "
            "non-finite shares from the target stage.</p>" + _folded(head, rows, "layers", {2, 3, 4, 5, 6, 7}, cls))


def _scaler(report: Report) -> str:
    sc = report.scaler
    if sc is None:
        return ""
    why = common.skip_reasons(sc.skips)
    parts = [f"<h2>GradScaler</h2><p><b>Pattern: {e(sc.pattern)}.</b> {t(sc.explanation)}</p><ul>",
             f"<li>scale: init {e(scale(sc.init_scale))}, final {e(scale(sc.final_scale))}, min {e(scale(sc.min_scale))}, "
             f"max {e(scale(sc.max_scale))}</li>",
             f"<li>skipped steps ({len(sc.skips)}): {e(steps([x.step for x in sc.skips]))}; why: {e(why)}</li>",
             f"<li>calibration skips: {e(common.calibration_line(sc))}</li></ul>"]
    stage = common.scaled_stage(report)
    if stage is not None:
        parts.append(_folded(["steps", "scale", "skipped"], [[e(c) for c in r] for r in _scale_runs(stage, common.step0(report))], "scale runs", {1, 2}))
    return "".join(parts)


def _findings(report: Report) -> str:
    out = []
    errors = [f for f in common.listed(report) if f.severity == "error"]
    other = [f for f in common.listed(report) if f.severity != "error"]
    told = common.history(report)
    if told is not None:  # the lookback ring's story of the steps before the failure
        out.append("<h2>Before the failure</h2><p><b>" + t(told.title) + "</b></p><ul>"
                   + "".join(f"<li>{t(x)}</li>" for x in told.evidence.get("lines", [])) + "</ul>")
    if errors:
        items = []
        for f in errors:
            ev = (f"<br><span class=\"muted\">evidence: {t(' '.join(evidence_words.evidence(f.evidence, f.module)))}</span>"
                  if f.evidence else "")
            fx = f"<br>fix: {t(f.fix)}" if f.fix else ""
            items.append(f"<li><b>{t(f.title)}</b>{ev}{fx}</li>")
        out.append("<h2>Evidence</h2><ul>" + "".join(items) + "</ul>")
    if other:
        out.append("<h2>Warnings</h2><ul>" + "".join(
            f"<li><b>{e(f.severity)}</b> <code>{e(f.code)}</code>: {t(f.title)}{(' — ' + t(f.fix)) if f.fix else ''}</li>"
            for f in other) + "</ul>")
    if report.notes:
        out.append("<h2>Notes</h2><ul>" + "".join(f"<li>{t(n)}</li>" for n in report.notes) + "</ul>")
    return "".join(out)


def _reproduce(report: Report) -> str:
    return reproduce_section(reproduce_command(report), report.environment.get("command"))


def reproduce_section(cmd: str | None, ran: Any) -> str:
    out = []
    if cmd:
        out.append(f"<p>With every option that shapes the run (same seed, same batches):</p><pre>{e(cmd)}</pre>")
    if ran:
        out.append(f"<p>The command that made this report:</p><pre>{e(ran)}</pre>")
    return "<h2>Reproduce</h2>" + "".join(out) if out else ""


def _environment(report: Report) -> str:
    return environment_section(report.environment, report.config)


def environment_section(env: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    if not env:
        return ""
    known = {k for k, _ in ENV_KEYS} | {"command"}
    rows = [[f"<b>{e(label)}</b>", e(num(env[k]) if env.get(k) is not None else "-")] for k, label in ENV_KEYS if k in env]
    rows += [[f"<b>{e(k)}</b>", e(num(v))] for k, v in env.items() if k not in known]
    cfg = [[e(k), e(common.option_value(v) if v is not None else "-")] for k, v in config.items() if k != "spec"]
    opts = f"<details><summary>Options</summary>{_table(['option', 'value'], cfg)}</details>" if cfg else ""
    return "<h2>Environment</h2>" + _table(None, rows) + opts


def render(report: Report, images: Mapping[str, bytes] | None = None, *, missing_plots: str | None = None) -> str:
    """The HTML page. ``images`` maps plot names to PNG bytes; None draws them (with matplotlib) when possible."""
    if images is None and missing_plots is None:
        from ampdoctor.render import plots

        if plots.available():
            images = plots.figures(report)
        else:
            missing_plots = plots.INSTALL_HINT
    v = report.verdict
    title = f"ampdoctor: {common.CAUSE_TITLES.get(v.cause, v.cause)}" + (f" in {common.spec_name(report)}" if common.spec_name(report) else "")
    fixes = ""
    if report.fixes:
        fixes = "<h2>What to change</h2><ol>" + "".join(f"<li>{t(f)}</li>" for f in report.fixes) + "</ol>"
    body = "".join([
        f"<h1>{e(common.CAUSE_TITLES.get(v.cause, v.cause))} <span class=\"muted\">{e(common.spec_name(report))}</span></h1>",
        f'<p class="muted">{t(run_words.what_ran(report.tool, report.config, common.ran_steps(report)))}</p>',
        _verdict(report), _code(report), fixes,
        _plots(images, missing_plots), _stages(report), _layers(report), _scaler(report), _findings(report),
        _reproduce(report), _environment(report),
        f'<p class="muted"><small>report schema {report.schema_version}</small></p>',
    ])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>{e(title)}</title><style>{CSS}</style></head>'
            f"<body><main>{body}</main></body></html>\n")
