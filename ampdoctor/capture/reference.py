"""Capture by reference: a run that saves checkpoints starts its capture from its own last checkpoint.

A capture normally holds a host copy of the model, optimizer and scaler state every ``snapshot_every``
steps (``capture.write``): for a 7B model that is the size of the model. A run that saves checkpoints
already has that state on disk. When the loop says it saved one (``Monitor.saved(path)``; the Trainer's
``AmpDoctorCallback`` says it at every ``checkpoint-N``), the capture keeps a *reference* in place of its
snapshot, no host copy: the checkpoint's path and the step it starts (the step after the save), and from
then on the batches, by value, as before. On the failing step it writes the batches since the checkpoint
and a manifest whose ``reference`` names the checkpoint (relative to the capture folder, so the two move
together); no ``state.pt``, no ``snapshot.pt``. ``triage --from`` reads the state from the checkpoint
(``input.checkpoint.read_checkpoint``: a Trainer ``checkpoint-N`` folder, a Lightning ``.ckpt``, a dict of
state dicts) and replays the batches from it to the failing step, as it replays a snapshot.

Where the batches since the checkpoint outgrow ``capture_hold_bytes``, the capture takes a snapshot of its
own as before (the reference is dropped); where no checkpoint was saved, snapshots stay the default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

REFERENCE = "reference"
"""The manifest field, and the key of the marker a capture holds in place of its snapshot."""
NEVER = 2**62
"""``snapshot_every`` while a reference stands: the run's checkpoints take the periodic snapshot's place."""


def saved(capture: Any, path: str | Path, next_step: int, on_error: Callable[[str, Exception], None] | None = None) -> None:
    """The run saved a checkpoint at ``path`` (a Trainer ``checkpoint-N`` folder, a Lightning ``.ckpt``, a ``torch.save``
    of the state dicts) holding the state ``next_step`` starts from: hold a reference to it in place of the capture's
    snapshot, and the batches from ``next_step`` on. ``Monitor.saved``; never raises into the loop (``on_error``)."""
    if capture is None or capture.done:
        return
    try:
        _refer(capture, path, next_step)
    except Exception as e:
        if on_error is None:
            raise
        on_error("noting a saved checkpoint", e)


def _refer(capture: Any, path: str | Path, next_step: int) -> None:
    capture._snapshot = {REFERENCE: {"path": str(Path(path).resolve()), "step": int(next_step)}}
    capture._snapshot_step = int(next_step)
    capture._snap_bytes = 0
    capture._batches.clear()
    capture._batch_steps.clear()
    capture._batch_bytes = 0
    capture.held = 0
    capture.snapshot_every = NEVER


def is_reference(snap: Any) -> bool:
    return isinstance(snap, dict) and set(snap) == {REFERENCE}


def written(capture: Any, files: dict[str, Any], snap: Any, batch_steps: list[int], folder: Path) -> dict[str, Any]:
    """At the capture's write: where the held snapshot is a reference and every batch since it is kept, the
    state files leave ``files`` (the checkpoint holds the state) and the manifest's ``reference`` names the
    checkpoint; else a reference that cannot re-reach the step is dropped from ``files``. Returns the manifest
    fields to add ({} when there is no reference)."""
    from ampdoctor.capture.schema import SNAPSHOT_FILE, STATE_FILE

    if not is_reference(snap):
        return {}
    files.pop(SNAPSHOT_FILE, None)
    ref = snap[REFERENCE]
    if not batch_steps or batch_steps[0] != ref["step"]:
        return {}  # the batches since the checkpoint were not all kept: state.pt (a skipped step) or nothing
    files.pop(STATE_FILE, None)
    where = os.path.relpath(ref["path"], folder.resolve())
    return {REFERENCE: {"kind": "checkpoint", "path": where, "step": ref["step"]}}


def start_state(folder: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None,
                                                                   dict[str, Any] | None, int]:
    """The state a by-reference capture starts from: (model state, optimizer state, scaler state, its step), read
    from the checkpoint the manifest names (relative to the capture folder). A checkpoint that is gone or does
    not load is one ``CaptureError`` line."""
    from ampdoctor.errors import AmpDoctorError, CaptureError
    from ampdoctor.input.checkpoint import read_checkpoint

    ref = manifest[REFERENCE]
    path = (folder / str(ref["path"])).resolve()
    shown = Path(os.path.relpath(path))
    if not path.exists():
        raise CaptureError(f"{folder}: the capture starts from the run's checkpoint {shown} (step {ref['step']}), which "
                           "is not there; put the checkpoint back beside the capture, or capture again")
    try:
        st = read_checkpoint(path)
    except AmpDoctorError as e:
        raise CaptureError(f"{folder}: the capture starts from the run's checkpoint {shown}: {e}") from None
    return st.model, st.optimizer, st.scaler, int(ref["step"])


__all__ = ["NEVER", "REFERENCE", "is_reference", "saved", "start_state", "written"]
