"""Safe output files: never overwrite without force; atomic writes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ampdoctor.errors import OutputExistsError, UsageError


def check_writable(path: str | Path, force: bool) -> Path:
    """Fail early, before any work, if ``path`` exists (without force) or its folder is missing."""
    p = Path(path)
    if p.exists() and not force:
        raise OutputExistsError(f"{p} exists; choose another path or pass --force to overwrite it")
    if p.is_dir():
        raise UsageError(f"{p} is a directory; give a file path")
    if not p.parent.exists():
        raise UsageError(f"folder {p.parent} does not exist; create it first")
    return p


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write to a temp file in the same folder, then rename over ``path``: all or nothing."""
    p = Path(path)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; a report is for sharing, so use the usual 0666 & ~umask
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
