"""``python -m ampdoctor.examples [FOLDER]``: copy the sample specs into ``FOLDER`` (default
``sample_models``), so that README's commands (``ampdoctor triage sample_models/forward_overflow.py``)
run the same from the released package as from a clone. Nothing that exists is overwritten."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def samples_dir() -> Path | None:
    """Where the sample specs are: inside the installed package (a wheel), or beside it (a clone)."""
    for d in (HERE / "sample_models", HERE.parent / "sample_models"):
        if any(d.glob("*.py")):
            return d
    return None


def copy_samples(dest: Path) -> list[Path]:
    """Copy every sample spec into ``dest`` (created if missing); a file that exists there is kept as it is.
    Returns the files written."""
    src = samples_dir()
    if src is None:
        raise FileNotFoundError("this installation of ampdoctor has no sample specs")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for f in sorted(src.glob("*.py")):
        target = dest / f.name
        if target.exists() or target.resolve() == f.resolve():
            continue
        shutil.copyfile(f, target)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m ampdoctor.examples [FOLDER]   (default: sample_models)", file=sys.stderr)
        return 2
    dest = Path(args[0] if args else "sample_models")
    if dest.exists() and not dest.is_dir():
        print(f"error: {dest} is a file; give a folder for the sample specs", file=sys.stderr)
        return 2
    if samples_dir() is None:
        print("error: this installation of ampdoctor has no sample specs; reinstall it from a wheel or use a clone",
              file=sys.stderr)
        return 2
    try:
        written = copy_samples(dest)
    except OSError as e:
        print(f"error: cannot copy the sample specs into {dest} ({e.strerror or e}); choose a folder you can write to",
              file=sys.stderr)
        return 2
    kept = "" if written else " (all there already; nothing overwritten)"
    print(f"{len(written)} sample spec(s) written to {dest}{kept}; try: ampdoctor triage {dest / 'forward_overflow.py'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
