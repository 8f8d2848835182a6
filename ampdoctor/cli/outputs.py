"""Every output file of ``ampdoctor triage``, checked before any stage runs; ``--json -`` (JSON on stdout).

A run can take minutes: an output that cannot be written must cost one line and exit code 2 at the
start, not a traceback (or a wrong verdict) at the end.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from ampdoctor.errors import OutputError, UsageError
from ampdoctor.io import check_folder_writable, check_writable

STDOUT = "-"
"""``--json -`` writes the JSON to stdout (and the human output to stderr)."""


def is_stdout(path: Path | None) -> bool:
    return path is not None and str(path) == STDOUT


def check_triage_outputs(json_path: Path | None, report_path: Path | Sequence[Path] | None, log: Path | None,
                         dump_dir: Path | None, force: bool) -> None:
    """Refuse (UsageError / OutputExistsError) any output that exists without --force, lies in a missing or
    unwritable folder, or names the same file as another output (``--report`` may be given several times)."""
    reports = [report_path] if isinstance(report_path, Path) else list(report_path or [])
    named = [(opt, p) for opt, p in (("--json", json_path), *(("--report", r) for r in reports), ("--log", log),
                                      ("--dump-dir", dump_dir)) if p is not None and not is_stdout(p)]
    for i, (opt_a, a) in enumerate(named):
        for opt_b, b in named[i + 1:]:
            if a.resolve() == b.resolve():
                raise UsageError(f"{opt_a} and {opt_b} both name {a}; give each output its own path")
    if json_path is not None and not is_stdout(json_path):
        check_writable(json_path, force)
    if log is not None:
        check_writable(log, force)
    for r in reports:
        from ampdoctor.cli.reports import check_report_path

        check_report_path(r, force)
    if dump_dir is not None:
        from ampdoctor.cli.dump import check_dump_dir

        check_dump_dir(dump_dir, force)
        check_folder_writable(dump_dir if dump_dir.is_dir() else dump_dir.parent, f"--dump-dir {dump_dir}")


def write_json_stdout(text: str) -> None:
    """The JSON report on stdout, newline-terminated, flushed (a pipe reader sees all of it)."""
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except OSError as e:  # stdout on a full disk (`--json - > file`), or /dev/full
        from ampdoctor.io import write_failure

        raise OutputError(write_failure(None, e, len(text.encode("utf-8")), what="the JSON report to stdout")) from None


@contextlib.contextmanager
def stdout_to_stderr(active: bool) -> Iterator[None]:
    """While the user's code runs under ``--json -``, what it prints goes to stderr, so that stdout carries
    the JSON alone: ``sys.stdout`` is stderr inside, and where stdout is a real file descriptor (a pipe,
    a file) descriptor 1 is pointed at stderr too, for C extensions and child processes (DataLoader
    workers). Everything is put back afterwards."""
    if not active:
        yield
        return
    saved_fd: int | None = None
    try:
        fd = sys.stdout.fileno()
        sys.stdout.flush()
        if fd == 1:
            saved_fd = os.dup(1)
            os.dup2(sys.stderr.fileno(), 1)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation (a test runner's stdout) is an OSError
        saved_fd = None
    real = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        sys.stdout = real
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
