"""``--report PATH``: choose the format by extension, check the path before any work, write atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampdoctor.errors import OutputExistsError, UsageError
from ampdoctor.io import check_folder_writable, check_writable, write_atomic, write_group
from ampdoctor.report.model import Report

FORMATS = {".md": "markdown", ".markdown": "markdown", ".json": "json", ".html": "html", ".htm": "html"}


def report_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UsageError(f"--report {path}: unknown extension {path.suffix or '(none)'!r}; use .md, .json or .html")
    return fmt


def check_report_path(path: Path, force: bool) -> Path:
    """Fail before any stage runs: bad extension, existing file without --force, missing folder."""
    fmt = report_format(path)
    p = check_writable(path, force)
    if fmt == "markdown":
        from ampdoctor.render.markdown import assets_dir

        folder = assets_dir(p)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"{folder} is a file; the Markdown report puts its plots in that folder")
        if folder.is_dir() and any(folder.iterdir()) and not force:
            raise OutputExistsError(f"{folder} (the plots of {p.name}) exists; pass --force to overwrite it")
        if folder.is_dir():
            check_folder_writable(folder, f"the plots of {p}")
    return p


def write_report(path: Path, report: Report) -> list[Path]:
    """Write the report (and, for Markdown, its PNGs) atomically; return the paths written, report last."""
    fmt = report_format(path)
    if fmt == "json":
        from ampdoctor.render.json import render as render_json

        write_atomic(path, render_json(report))
        return [path]
    if fmt == "html":
        from ampdoctor.render.html import render as render_html

        write_atomic(path, render_html(report))
        return [path]
    from ampdoctor.render.markdown import outputs

    return write_files(path, outputs(report, path))


def write_files(path: Path, files: dict[Path, str | bytes]) -> list[Path]:
    """Write a report at ``path`` and its images (``files``) all or nothing (``io.write_group``: a full disk
    leaves no half of it), images first; return them, report last."""
    # images first, the Markdown last: a reader never finds a report whose images are missing
    return write_group(dict(sorted(files.items(), key=lambda kv: kv[0] == path)))


def write_layers_report(path: Path, doc: dict[str, Any]) -> list[Path]:
    """Write an ``ampdoctor layers`` report document (``layers_report.build``) by extension, like ``write_report``."""
    fmt = report_format(path)
    if fmt == "json":
        from ampdoctor.report.layers_doc import to_json

        write_atomic(path, to_json(doc))
        return [path]
    if fmt == "html":
        from ampdoctor.render.layers_html import render as render_html

        write_atomic(path, render_html(doc))
        return [path]
    from ampdoctor.render.layers_markdown import outputs

    return write_files(path, outputs(doc, path))
