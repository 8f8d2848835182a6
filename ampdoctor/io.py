"""Safe output files: never overwrite without force; atomic writes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ampdoctor.errors import OutputExistsError, UsageError


def check_writable(path: str | Path, force: bool) -> Path:
    """Fail early, before any work, if ``path`` exists (without force), is read-only, or its folder is
    missing or not writable."""
    p = Path(path)
    if p.exists() and not force:
        raise OutputExistsError(f"{p} exists; choose another path or pass --force to overwrite it")
    if p.is_dir():
        raise UsageError(f"{p} is a directory; give a file path")
    if not p.parent.exists():
        raise UsageError(f"folder {p.parent} does not exist; create it first")
    if not p.parent.is_dir():
        raise UsageError(f"{p.parent} is a file, not a folder; give a path inside a folder")
    check_folder_writable(p.parent, str(p))
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{p} is read-only; make it writable or choose another path")
    return p


def check_folder_writable(folder: Path, what: str) -> None:
    """Create and remove a temporary file in ``folder``: the one test that sees permissions, ACLs and
    read-only mounts alike (``os.access`` says yes to root on a read-only mount)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".ampdoctor-probe.", dir=folder)
    except OSError as e:
        raise UsageError(f"cannot write {what}: folder {folder} is not writable ({e.strerror or e}); "
                         "choose a folder you can write to") from None
    os.close(fd)
    os.unlink(tmp)


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
