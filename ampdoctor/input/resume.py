"""Start from saved state: a capture folder (``Monitor(capture=...)``, read by ``capture.read``) or a training
checkpoint (``input.checkpoint``), loaded into the model, optimizer and GradScaler the spec builds.

Both readers give a ``Saved``: the weights, the optimizer and GradScaler state, where they came from. ``load_into``
loads one, checked first, with one rule for both: the weights' keys are fitted to the model's
(``checkpoint.match_keys``: a prefix stripped or added, a tied key filled from its twin) and load strictly, the
optimizer state must have the optimizer's parameter groups, the scaler's loads when it is enabled; a part that is
missing is left as built and said. ``StartState`` is where the stages then start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ampdoctor.errors import CaptureError, CheckpointError
from ampdoctor.input.checkpoint import first_line, match_keys, match_optimizer


@dataclass
class StartState:
    """Where the stages start: the optimizer and GradScaler state (the model's goes into ``Run.init_state``)."""

    optimizer: dict[str, Any] | None
    scaler: dict[str, Any] | None
    step0: int
    """The run's own step number of the first replayed batch."""
    rng: dict[str, Any] | None = None
    """RNG states to restore before every stage (the capture's ``rng.pt``, a checkpoint's RNG file)."""


class Saved(Protocol):
    """Saved state, read: a capture (``capture.folder.Captured``) or a checkpoint (``input.checkpoint.CheckpointState``)."""

    @property
    def model(self) -> dict[str, torch.Tensor]:
        """The weights, a state_dict."""

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """``optimizer.state_dict()``, or None when none was saved."""

    @property
    def scaler(self) -> dict[str, Any] | None:
        """``GradScaler.state_dict()``, or None when none was saved."""

    @property
    def source(self) -> Path:
        """The file or folder it was read from (messages start with it)."""

    @property
    def kind(self) -> str:
        """'capture' | 'checkpoint': what messages call it."""


def match_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor] | Saved) -> dict[str, torch.Tensor]:
    """The saved weights keyed as ``model`` expects, so ``load_state_dict`` loads strictly (``checkpoint.match_keys``);
    one line naming the first missing, unexpected and mismatched keys otherwise."""
    if isinstance(state, Mapping):
        return match_keys(model, state)[0]
    return match_keys(model, state.model, f"{state.source}: ", state.kind)[0]


def load_into(state: Saved, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
              scaler: Any = None) -> list[str]:
    """Load ``state`` into live objects, checked first; return a sentence for each part it lacks.

    The model loads strictly (keys fitted by ``match_state``); the optimizer after ``match_optimizer``;
    the scaler when it is enabled. A part the saved state does not have is left as built, and said.
    A capture's errors are ``CaptureError``, a checkpoint's ``CheckpointError``: one line each.
    """
    said: list[str] = []
    model.load_state_dict(match_state(model, state))
    if optimizer is not None:
        if state.optimizer is None:
            said.append(f"{state.source}: no optimizer state; the optimizer starts fresh (Adam's moments at zero)")
        else:
            match_optimizer(optimizer, state.optimizer)
            try:
                optimizer.load_state_dict(state.optimizer)
            except (ValueError, KeyError, RuntimeError) as e:
                error = CheckpointError if state.kind == "checkpoint" else CaptureError
                raise error(f"{state.source}: the optimizer state does not load into build_optimizer()'s optimizer "
                            f"({first_line(e)}); build the optimizer the run used") from None
    if scaler is not None and scaler.is_enabled():
        if state.scaler is None:
            said.append(f"{state.source}: no GradScaler state; the scale starts at {scaler.get_scale():g}, not the run's")
        else:
            scaler.load_state_dict(state.scaler)
    return said


__all__ = ["Saved", "StartState", "load_into", "match_state"]
