"""Safe output files: never overwrite without force; atomic writes; a full disk is one line.

Every output ampdoctor writes goes through ``write_atomic`` (one file) or ``write_group`` (a report
and its images, a dump folder): the data goes to temporary files in the target folder first, and
only when every one of them is complete are they renamed over their targets. A write that fails
(no space left, a quota, an I/O error) removes the temporary files and any folder it created, so an
existing file is left as it was and no half-written one is left behind; it raises ``OutputError``
naming the path and how many bytes were needed.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ampdoctor.errors import OutputError, OutputExistsError, UsageError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""The errors that mean 'the bytes do not fit' (a full disk, a quota, a file-size limit)."""


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
        if e.errno in NO_SPACE:
            raise OutputError(write_failure(folder / Path(what).name, e, None)) from None
        raise UsageError(f"cannot write {what}: folder {folder} is not writable ({e.strerror or e}); "
                         "choose a folder you can write to") from None
    os.close(fd)
    os.unlink(tmp)


def human_bytes(n: float) -> str:
    """1.5 kB, 7.7 MB (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def free_bytes(folder: str | Path) -> int | None:
    """Bytes this process may still write in ``folder``'s file system, when the OS says."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def write_failure(path: str | Path | None, e: OSError, needed: int | None, what: str | None = None) -> str:
    """The one line for an output that could not be written: what, why, how much was needed and what to do.
    ``path`` None (stdout): no free space is named and nothing is said to be kept."""
    name = what or str(path)
    if e.errno in NO_SPACE:
        why = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EFBIG: "the file is larger than this file system allows"}[e.errno]
        free = free_bytes(Path(path).parent) if path is not None else None
        need = f"{human_bytes(needed)} needed" if needed is not None else "more space needed"
        have = f", {human_bytes(free)} free there" if free is not None else ""
        kept = "; nothing was written there" if path is not None else ""
        return f"cannot write {name}: {why} ({need}{have}); free some space or choose a path on another disk{kept}"
    return f"cannot write {name}: {e.strerror or e} ({type(e).__name__}); check the disk, or choose another path"


def _size(data: str | bytes) -> int:
    return len(data) if isinstance(data, bytes) else len(data.encode("utf-8"))


def _write_fd(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a new file's descriptor, flush it to the disk, close it (the tests patch this
    to simulate a full disk where no small file system can be mounted)."""
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write to a temp file in the same folder, then rename over ``path``: all or nothing. A write that
    fails leaves ``path`` as it was and raises ``OutputError`` (one line naming the path and the bytes)."""
    write_group({Path(path): data})


def write_group(files: Mapping[Path, str | bytes], what: str | None = None) -> list[Path]:
    """Write several files all or nothing: every one to a temporary file first (creating missing
    folders), then each renamed over its target in the order given. On a failure the temporary files
    and the folders this call created are removed, nothing is renamed, and ``OutputError`` names
    ``what`` (default: the last path, e.g. the report after its images) and the file that failed, and the
    bytes the whole group needed. Returns the paths, in order."""
    paths = [Path(p) for p in files]
    total = sum(_size(d) for d in files.values())
    made: list[Path] = []
    temps: list[tuple[str, Path]] = []
    current = paths[0] if paths else Path(".")
    umask = os.umask(0)
    os.umask(umask)
    try:
        for p, data in zip(paths, files.values(), strict=True):
            current = p
            if not p.parent.exists():
                p.parent.mkdir()
                made.append(p.parent)
            fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
            temps.append((tmp, p))
            _write_fd(fd, data if isinstance(data, bytes) else data.encode("utf-8"))
            # mkstemp creates 0600; a report is for sharing, so use the usual 0666 & ~umask
            os.chmod(tmp, 0o666 & ~umask)
        for tmp, p in temps:
            current = p
            os.replace(tmp, p)
    except BaseException as e:
        for tmp, _ in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for d in reversed(made):
            shutil.rmtree(d, ignore_errors=True)
        if isinstance(e, OSError):
            name = what or (str(paths[-1]) if paths else str(current))
            if len(paths) > 1 and Path(name) != current:
                name = f"{name} ({current.name} of its {len(paths)} files)"
            raise OutputError(write_failure(current, e, total, what=name)) from None
        raise
    return paths
