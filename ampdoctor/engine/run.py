"""``Run``: what one triage ran on and what it found, kept so that outputs reuse it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.input.batches import Batches
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.spec import Spec
from ampdoctor.records import StageResult, UserHook


@dataclass
class Replay:
    """How a triage replayed a capture (``triage --from``)."""

    capture: Path
    manifest: dict[str, Any]
    step0: int
    """The run's own number of the first replayed step: report steps are offset by it."""
    precision: str
    """The run's own precision, replayed twice from the captured state."""
    reproduced: int
    """How many of the replays failed again."""
    replays: int
    last: list[dict[str, float | None]]
    """Loss, gradient norm and scale of the failing step in each replay."""
    ring: Any = None
    """The capture's lookback ring: (steps, layers) DataFrames (``capture.schema.read_ring``), or None."""
    differs: list[tuple[str, str, str]] = field(default_factory=list)
    """Modules whose settings differ between the run's model and the replay's (``input.origin.differences``)."""


@dataclass
class Run:
    """The spec, the options, the FP32 model (back at its initial weights after triage), the exact
    batches every stage replayed, the initial state, and each stage's result.

    ``--dump-dir``, the FP32 re-check and the op scan read the model and batches from here instead
    of loading the spec and building the dataloader again.
    """

    spec: Spec
    config: TriageConfig
    device: torch.device
    model: nn.Module
    batches: Batches
    init_state: dict[str, torch.Tensor]
    results: dict[str, StageResult] = field(default_factory=dict)
    spec_arg: str = ""
    """The spec path as the user gave it (reports quote it)."""
    user_hooks: list[str] = field(default_factory=list)
    """Gradient hooks the user's model carries (they can hide overflows from GradScaler)."""
    hook_list: list[UserHook] = field(default_factory=list)
    """The same hooks as data (``watch.userhooks.found``)."""
    replay: Replay | None = None
    """Set when the run replays a capture."""
    start: str = ""
    """Where the stages started when not from the initial weights: a note for the report."""
    step0: int = 0
    """The run's own number of the first step the stages ran (a replay's or a checkpoint's)."""
    said: list[str] = field(default_factory=list)
    """Where the model, the optimizer and the data came from when the run said it (report notes)."""
    start_kind: str = "init"
    """Where the stages started: ``init`` (the spec's initial weights), ``capture`` or ``checkpoint``."""
    start_label: str = ""
    """The checkpoint as the report names it ("checkpoint-130", "the checkpoint ckpt.pt") when ``start_kind`` is
    ``checkpoint``."""
    rng_restored: list[str] = field(default_factory=list)
    """The RNG states set before every stage (``torch``, ``cuda``, ``numpy``, ``python``); empty: seeded."""
    compiled: dict[str, Any] | None = None
    """The compile rung's failing step bisected over the backends (``engine.compiled.compile_facts``), or None."""

    def reset(self) -> None:
        """Put the model back at its initial weights."""
        self.model.load_state_dict(self.init_state)
