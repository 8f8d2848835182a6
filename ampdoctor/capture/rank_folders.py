"""Every rank's capture folder of one failing step: found beside the one the user names (``cap.rank0``,
``cap.rank1``... and, when another job captured into the same folder, ``cap.rank0-1``...), picked by the run they
belong to (``run_id``, the model's fingerprint, the step, the world size), never mixed across runs.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any

from ampdoctor.capture.schema import MANIFEST, read_manifest
from ampdoctor.errors import CaptureError

RANK_FOLDER = re.compile(r"^(?P<base>.*)\.rank(?P<rank>\d+)(?P<n>-\d+)?$")
"""``<base>.rank<N>``, or ``<base>.rank<N>-<k>``: the numbered name a capture takes when its own is taken (a second
job capturing under the same name into the same folder, ``capture.write.free_path``)."""


def _candidates(folder: Path, base: str) -> dict[int, list[Path]]:
    """Every rank's capture folders named ``<base>.rank<N>[-<k>]`` in ``folder``, by rank (unnumbered first)."""
    out: dict[int, list[Path]] = {}
    for q in sorted(folder.glob(f"{glob.escape(base)}.rank*"), key=lambda q: (len(q.name), q.name)):
        mm = RANK_FOLDER.match(q.name)
        if mm is not None and mm.group("base") == base and (q / MANIFEST).is_file():
            out.setdefault(int(mm.group("rank")), []).append(q)
    return out


def identity(m: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """What makes captures one step of one run: (run id, step, world size, model fingerprint); a field an older
    capture lacks is None."""
    return m.get("run_id"), m.get("step"), m.get("world_size"), m.get("model_fingerprint")


def _suffix(q: Path) -> str:
    mm = RANK_FOLDER.match(q.name)
    return (mm.group("n") or "") if mm else ""


def _pick(qs: list[Path], suffix: str, want: tuple[Any, ...]) -> Path:
    """Of one rank's folders, the one of the same run and step as the named folder (its run id), else the one
    numbered as it (``-1``...), else the first: a mix is then refused naming both folders (``_read_all``)."""
    same = [q for q in qs if _suffix(q) == suffix]
    if want[0] is not None:
        for q in [*same, *qs]:
            try:
                if identity(read_manifest(q / MANIFEST))[:2] == want[:2]:
                    return q
            except CaptureError:
                continue
    return same[0] if same else qs[0]


def group_of(p: Path) -> dict[int, Path]:
    """The per-rank folders of the step ``p`` names (``p`` one of them, or the ``capture=`` name the run was given):
    by rank, the folder of the same run and step (its manifest's ``run_id``), a second job's numbered folders
    (``cap.rank0-1``, ``cap.rank1-1``) grouped together."""
    m = RANK_FOLDER.match(p.name)
    base = m.group("base") if m else p.name
    suffix = (m.group("n") or "") if m else ""
    found = _candidates(p.parent, base)
    one = p if m else next((qs[0] for qs in found.values()), None)
    if one is None or not (one / MANIFEST).is_file():
        return {}
    want = identity(read_manifest(one / MANIFEST))
    return {r: (one if m and r == int(m.group("rank")) and one in qs else _pick(qs, suffix, want))
            for r, qs in sorted(found.items())}


def rank_folders(p: Path) -> dict[int, Path]:
    """The per-rank capture folders of one sharded step (``group_of``), when ``p`` names a sharded capture with a
    layout; else empty (a whole model's capture, or one rank's of DDP, is read alone)."""
    m = RANK_FOLDER.match(p.name)
    if m and not (p / MANIFEST).is_file():
        return {}
    if not m and p.is_dir():
        return {}
    found = group_of(p)
    one = p if m else (next(iter(found.values())) if found else None)
    if one is None:
        return {}
    own = read_manifest(one / MANIFEST)
    if not own.get("sharded") or not own.get("shards"):
        return {}
    return found


def rank_captures(p: Path) -> dict[int, Path]:
    """The per-rank capture folders of one sharded step beside ``p`` (``rank_folders``)."""
    return rank_folders(p)


__all__ = ["group_of", "identity", "rank_captures", "rank_folders"]
