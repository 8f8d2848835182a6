"""Read a capture folder (``Monitor(capture=...)``) into the state triage replays from.

The spec builds the architecture (``build_model``, ``build_optimizer``); the weights, optimizer
state, GradScaler state and batches come from the capture. The replay starts from the state before
the failing step when the capture has it (``state.pt``: the step was skipped, so nothing was
applied) and runs the failing batch alone; otherwise from the last periodic snapshot through every
batch since, the failing one last. Errors are one line (``CaptureError``), never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.capture.folder import Captured, read_rank
from ampdoctor.capture.rank_folders import rank_captures
from ampdoctor.capture.reassemble import reassemble_group
from ampdoctor.capture.schema import MANIFEST
from ampdoctor.errors import CaptureError
from ampdoctor.watch.model_view import unwrap, user_name


def read_capture(path: str | Path) -> Captured:
    """Read and check a capture folder; raise CaptureError (one line) saying what is wrong.

    Every manifest field is validated against ``ampdoctor/schema/capture.schema.json`` and every tensor
    file's layout (``capture.schema``) before anything is used: a capture is a file users mail to
    each other, and a damaged one is one line naming the file and the field."""
    p = Path(path)
    group = rank_captures(p)
    if group:  # every rank's shard of a sharded step, put together (capture.reassemble: the one reader)
        return reassemble_group(p, group)
    if not p.is_dir():
        raise CaptureError(f"{p}: no such capture folder; pass the folder Monitor(capture=...) wrote")
    mf = p / MANIFEST
    if not mf.exists():
        raise CaptureError(f"{p}: no {MANIFEST}; this is not an ampdoctor capture folder")
    return read_rank(p)


def layout_optimizer(layout: dict[str, Any] | None) -> Callable[[nn.Module], torch.optim.Optimizer] | None:
    """``build_optimizer(model)`` rebuilding the captured optimizer (its ``torch.optim`` class and parameter
    groups, by parameter name), for a spec that has none; None when the class is not in ``torch.optim``."""
    if not layout or layout.get("module", "").split(".")[:2] != ["torch", "optim"]:
        return None
    cls = getattr(torch.optim, str(layout.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        return None
    groups = layout.get("groups") or []

    def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        named = {user_name(n): p for n, p in unwrap(model).named_parameters()}  # (an engine's wrapper: the user's names)
        built = [{"params": [named[n] for n in g["params"] if n in named],
                  **{k: tuple(v) if isinstance(v, list) else v for k, v in g["hyper"].items()}} for g in groups]
        return cls(built)  # type: ignore[call-arg]

    return build_optimizer


__all__ = ["layout_optimizer", "read_capture"]
