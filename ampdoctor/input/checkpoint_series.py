"""Checkpoints for ``ampdoctor check``: the paths given, expanded into one checkpoint each, read safely.

A path is a checkpoint (a file, a Trainer ``checkpoint-N/`` folder, a torch.distributed.checkpoint folder) or a
folder of them: a run's output folder holding ``checkpoint-N/`` subfolders, or a Lightning ``checkpoints/`` folder
of ``.ckpt`` files. A series is sorted by the step each checkpoint records (the folder's N when it records none).

Reading reuses ``input.checkpoint`` (``torch.load(weights_only=True)``: a pickle that needs code is refused in
one line, never run) and ``input.dcp`` for torch.distributed.checkpoint folders. An optimizer state's entries are
named after the weights they belong to (``optimizer_names``): by the names the optimizer saved (torch's
``param_names``), else by the order and shapes of the weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ampdoctor.errors import CheckpointError
from ampdoctor.input.checkpoint import CheckpointState, read_checkpoint

CKPT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")


@dataclass
class Loaded:
    """One checkpoint of the series: its state, or the one line that says why it could not be read."""

    path: Path
    state: CheckpointState | None
    error: str = ""
    order: int = 0
    """Its place on the command line (the series is sorted by step, then by this)."""

    @property
    def step(self) -> int | None:
        if self.state is not None and self.state.step is not None:
            return self.state.step
        m = re.search(r"(?:checkpoint|step|iter)[-_=]?(\d+)", self.path.name)
        return int(m.group(1)) if m else None


def _step_of_name(p: Path) -> int:
    m = re.fullmatch(r"checkpoint-(\d+)", p.name)
    return int(m.group(1)) if m else -1


def expand(paths: Iterable[str | Path]) -> list[Path]:
    """Each path as the checkpoints it names: a run folder's ``checkpoint-N/`` subfolders (by N), a folder of
    checkpoint files (``CKPT_SUFFIXES``, by name) that is not itself a checkpoint, else the path itself. A path that does not exist is one line."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise CheckpointError(f"{p}: no such file or folder; pass a checkpoint, or the run's output folder")
        if p.is_dir():
            subs = sorted((s for s in p.iterdir() if s.is_dir() and _step_of_name(s) >= 0), key=_step_of_name)
            own = any((p / n).is_file() for n in ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                                                  "pytorch_model.bin.index.json", ".metadata"))
            ckpts = [] if own else sorted(s for s in p.iterdir() if s.is_file() and s.suffix in CKPT_SUFFIXES)
            if subs or ckpts:
                out += subs + ckpts
                continue
        out.append(p)
    if not out:
        raise CheckpointError("no checkpoint given; pass checkpoint files or folders (checkpoint-*/, *.ckpt, *.pt)")
    return out


def _is_dcp(p: Path) -> bool:
    return p.is_dir() and (p / ".metadata").is_file()


def _is_deepspeed(p: Path) -> bool:
    return p.is_dir() and (any(p.glob("*/mp_rank_*_model_states.pt")) or any(p.glob("mp_rank_*_model_states.pt"))
                           or (p / "latest").is_file() and any(p.glob("global_step*")))


def read_one(path: Path) -> CheckpointState:
    """One checkpoint, weights only; CheckpointError (one line) when it cannot be read."""
    if _is_dcp(path):
        from ampdoctor.input.dcp import read_dcp

        return read_dcp(path)
    if _is_deepspeed(path):
        raise CheckpointError(f"{path}: a DeepSpeed checkpoint folder; convert it with the zero_to_fp32.py script DeepSpeed "
                              "writes into it (python zero_to_fp32.py . out.pt) and check out.pt, or check the "
                              "Trainer's checkpoint-N/ folder around it")
    return read_checkpoint(path)


def read_series(paths: Iterable[str | Path]) -> Iterator[Loaded]:
    """Every checkpoint the paths name, read one at a time (the caller judges it and lets it go: a series of large
    checkpoints is never all in memory), an unreadable one with its one-line reason. The caller sorts them by
    ``Loaded.step``."""
    for i, p in enumerate(expand(paths)):
        try:
            yield Loaded(p, read_one(p), order=i)
        except CheckpointError as e:
            yield Loaded(p, None, str(e), order=i)


# ------------------------------------------------------------------------------------ optimizer names


def _float_weights(model: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in model.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _shapes(state: Mapping[Any, Any], ids: list[Any]) -> list[tuple[int, ...] | None]:
    """The shape of each id's state tensors (None when it holds none bigger than a scalar)."""
    out: list[tuple[int, ...] | None] = []
    for i in ids:
        ts = [t for t in (state.get(i) or {}).values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        out.append(tuple(ts[0].shape) if ts else None)
    return out


def _by_order(weights: list[tuple[str, tuple[int, ...]]], shapes: list[tuple[int, ...] | None]) -> list[str] | None:
    """Each optimizer entry matched, in order, to the next weight of its shape (weights without one are skipped:
    a buffer, a frozen weight); None when some entry finds none."""
    names: list[str] = []
    j = 0
    for shape in shapes:
        while j < len(weights) and shape is not None and weights[j][1] != shape:
            j += 1
        if j >= len(weights):
            return None
        names.append(weights[j][0])
        j += 1
    return names


def optimizer_names(model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any]) -> tuple[dict[Any, str], str]:
    """The weight name of each optimizer state entry, and how it was found ('' when the optimizer saved them)."""
    groups = list(optimizer.get("param_groups") or [])
    ids = [i for g in groups for i in g.get("params", [])]
    if groups and all("param_names" in g for g in groups):
        return dict(zip(ids, [n for g in groups for n in g["param_names"]], strict=False)), ""
    if ids and all(isinstance(i, str) and i in model for i in ids):  # keyed by name (get_state_dict, DCP)
        return {i: i for i in ids}, ""
    state = optimizer.get("state") or {}
    shapes = _shapes(state, ids)
    weights = _float_weights(model)
    names: list[str] | None = []
    at = 0
    for g in groups:  # each group matched in the weights' order, among the weights earlier groups left
        n = len(g.get("params", []))
        got = _by_order([w for w in weights if names is not None and w[0] not in names], shapes[at:at + n])
        names = names + got if names is not None and got is not None else None
        at += n
    if names is not None and len(set(names)) == len(names) == len(ids):
        return dict(zip(ids, names, strict=True)), "by the order and shapes of the weights"
    return {i: f"optimizer entry {i}" for i in ids}, "not matched to the weights (their shapes differ)"


__all__ = ["CKPT_SUFFIXES", "Loaded", "expand", "optimizer_names", "read_one", "read_series"]
