"""`ampdoctor lint PATH...`: AMP mistakes in training scripts, read from their text (nothing is run)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from ampdoctor.cli.common import boundary, fail, out
from ampdoctor.cli.helpstyle import default
from ampdoctor.errors import UsageError
from ampdoctor.lint import RULES, LintFinding
from ampdoctor.lint.checker import Result, lint_paths
from ampdoctor.lint.config import nearest_pyproject, selection

FORMATS = ("text", "concise", "github", "json")


@boundary
def lint(
    paths: Annotated[Optional[list[Path]], typer.Argument(
        metavar="PATH", help="Python files or folders (walked for *.py)." + default("."), show_default=False)] = None,
    output_format: Annotated[str, typer.Option("--format", metavar="FORMAT", help="text, concise, github (annotations) or json.")] = "text",
    select: Annotated[Optional[str], typer.Option(metavar="CODES", help="Only these rules or prefixes, e.g. AMP001,AMP003.")] = None,
    ignore: Annotated[Optional[str], typer.Option(metavar="CODES", help="Leave out these rules (besides the config's).")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(metavar="GLOB", help="Skip these files (repeatable; besides the config's).")] = None,
    amp: Annotated[bool, typer.Option("--amp", help="Treat the files as run under AMP (a model file).")] = False,
    list_rules: Annotated[bool, typer.Option("--list-rules", help="Print the rules (code and title) and exit.")] = False,
) -> None:
    """Find AMP mistakes in training scripts without running them: path:line:col: AMPxxx message.

    Exit code 0: nothing found; 1: findings; 2: bad input. A # noqa: AMP001 comment silences a line; the nearest pyproject.toml's \\[tool.ampdoctor.lint] gives select, ignore and exclude. --amp: the gradient-hook rules apply to a file that names neither autocast nor GradScaler.
    """
    if output_format not in FORMATS:
        fail(f"--format takes {', '.join(FORMATS)} (got {output_format!r})")
        return
    if list_rules:
        for r in RULES:
            out.print(f"{r.code}  {r.title}", markup=False, highlight=False, soft_wrap=True)
        return
    given = list(paths or [Path(".")])
    res = Result()
    # each path with the selection of its nearest pyproject.toml
    for p in given:
        if not p.exists():
            raise UsageError(f"{p}: no such file or folder; give Python files or folders to check")
        sel = selection(nearest_pyproject(p), select, ignore, exclude)
        part = lint_paths([p], sel, amp=amp)
        res.findings += part.findings
        res.files += part.files
        res.errors += part.errors
        res.skipped += part.skipped
    found = list(dict.fromkeys(res.findings))
    if output_format == "json":
        sys.stdout.write(json.dumps([as_dict(f) for f in found], indent=2) + "\n")
    elif output_format == "github":
        for f in found:
            sys.stdout.write(github_line(f) + "\n")
    else:
        _text(found, res, concise=output_format == "concise")
    for note in res.skipped:  # one line each: a file left unchecked on purpose is never silent
        sys.stderr.write(f"note: {note}\n")
    if res.errors:
        more = f" ({len(res.errors) - 1} more file(s) like it)" if len(res.errors) > 1 else ""
        fail(res.errors[0] + more)
    raise typer.Exit(1 if found else 0)


def as_dict(f: LintFinding) -> dict[str, object]:
    return {"path": f.path, "line": f.line, "col": f.col, "code": f.code, "message": f.message, "fix": f.fix}


def _escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_prop(s: str) -> str:
    return _escape_data(s).replace(":", "%3A").replace(",", "%2C")


def github_line(f: LintFinding) -> str:
    """A GitHub Actions workflow command: ``::warning file=...,line=...,col=...,title=AMPxxx::message``."""
    props = f"file={_escape_prop(f.path)},line={f.line},col={f.col},title={_escape_prop(f.code)}"
    return f"::warning {props}::{_escape_data(f.message + chr(10) + 'fix: ' + f.fix)}"


def _text(found: list[LintFinding], res: Result, *, concise: bool) -> None:
    width = max(40, min(out.width, 100))
    for f in found:
        line = Text()
        line.append(f.location(), style="bold")
        line.append(": ")
        line.append(f.code, style="bold red")
        line.append(f" {f.message}")
        out.print(line, highlight=False, soft_wrap=True)
        if not concise:
            out.print(textwrap.fill(f"fix: {f.fix}", width, initial_indent="    ", subsequent_indent="    "),
                      markup=False, highlight=False, soft_wrap=True, style="dim")
    files = len({f.path for f in found})
    checked = f"{res.files} file{'s' if res.files != 1 else ''} checked"
    left = len(res.errors) + len(res.skipped)
    checked += f", {left} not checked" if left else ""
    if found:
        out.print(f"Found {len(found)} finding{'s' if len(found) != 1 else ''} in {files} file{'s' if files != 1 else ''} "
                  f"({checked}).", markup=False, highlight=False)
    else:
        out.print(f"No AMP mistakes found ({checked}).", markup=False, highlight=False)
