"""Issue 45, item 7: the capture tests that lower ``init_scale`` (to be past GradScaler's calibration) run again with
``GradScaler()`` untouched: the same test body, with every ``torch.amp.GradScaler(...)`` it makes built with
GradScaler's defaults (``init_scale`` 2^16, ``growth_interval`` 2000). Their assertions hold with the defaults:
GradScaler's own back-offs take no capture. (Tests whose assertions name the lowered scale itself, and the framework
tests, have their defaults twins in ``test_skip_judgement_frameworks.py``.)"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

_GradScaler = torch.amp.GradScaler


def _untouched(*args: Any, **kw: Any) -> torch.amp.GradScaler:
    """GradScaler as people make it: the device, nothing else."""
    return _GradScaler(*args, **{k: v for k, v in kw.items() if k in ("device", "enabled")})


TWINS = [
    ("tests.test_capture_accumulated", "test_an_accumulated_step_is_captured_with_its_micro_batches_and_replays",
     {"how": "step"}),
    ("tests.test_capture_accumulated", "test_an_accumulated_step_is_captured_with_its_micro_batches_and_replays",
     {"how": "backward"}),
    pytest.param("tests.test_ring", "test_a_loss_spike_is_captured_and_names_the_layers_whose_updates_spiked_first", {},
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("module", "name", "kw"), TWINS)
def test_twin_with_gradscaler_untouched(module: str, name: str, kw: dict[str, Any], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    test = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(torch.amp, "GradScaler", _untouched)
    test(tmp_path=tmp_path, **kw)


@pytest.mark.slow
def test_twin_of_the_nanogpt_loop_without_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_do_no_harm import test_a_capture_without_batch_keeps_the_forwards_inputs_and_replays_as_data as t

    monkeypatch.setattr(torch.amp, "GradScaler", _untouched)
    t(tmp_path=tmp_path)
