"""One capture folder read into the state a replay starts from (``Captured``): its manifest, the model's (or this
rank's pieces of the) weights, the optimizer and GradScaler state, the batches and the RNG states, every file checked
against the format (``capture.schema``) before anything is used. Errors are one line (``CaptureError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ampdoctor.capture import reference as capture_ref
from ampdoctor.capture.schema import (
    BATCHES_FILE,
    MANIFEST,
    MICRO_KEY,
    MODEL_INPUTS_KEY,
    RNG_FILE,
    SNAPSHOT_FILE,
    STATE_FILE,
    read_manifest,
    read_ring,
    validate_batches,
    validate_state,
)
from ampdoctor.errors import CaptureError
from ampdoctor.input.batches import Micro, ModelInputs
from ampdoctor.input.resume import StartState
from ampdoctor.ladder import registered, rung


@dataclass
class Captured:
    """A capture folder, read."""

    path: Path
    manifest: dict[str, Any]
    model: dict[str, torch.Tensor]
    start: StartState
    batches: list[Any]
    from_snapshot: bool
    """True when the replay starts from the periodic snapshot (several batches), not the failing step's state."""
    rng: dict[str, Any] | None = None
    """``rng.pt``: the RNG states (torch, CUDA, numpy, python) when the capture holds them."""
    assembled: str | None = None
    """A sharded run's capture: how the ranks' shards were put back together (the report says it)."""
    ring: Any = None
    """The lookback ring's tables (steps, layers) as DataFrames (``capture.schema.read_ring``), or None."""

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """The optimizer state the replay starts from (``input.resume.Saved``)."""
        return self.start.optimizer

    @property
    def scaler(self) -> dict[str, Any] | None:
        """The GradScaler state the replay starts from."""
        return self.start.scaler

    @property
    def source(self) -> Path:
        return self.path

    @property
    def kind(self) -> str:
        """What it is, in the words of a message: 'capture'."""
        return "capture"

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def precision(self) -> str:
        """The run's own precision as the triage stage that replays it (``ladder.rung``): amp | bf16 | fp32,
        what the Monitor saw (an FP16 autocast without a GradScaler, ``fp16_autocast``, replays as amp)."""
        p = str(self.manifest.get("precision", "amp"))
        return p if p in registered() and not rung(p).low_weights else "amp"


def _load(path: Path, name: str) -> Any:
    f = path / name
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CaptureError(f"{path}: {name} is missing; the capture is incomplete (capture again)") from None
    except Exception as e:
        raise CaptureError(f"{path}: {name} cannot be read ({type(e).__name__}: {str(e).strip().splitlines()[0][:160]}); "
                           "the file is truncated or not an ampdoctor capture") from None


def read_rank(p: Path) -> Captured:
    """One rank's capture folder alone (its own pieces of a sharded model, not reassembled)."""
    return _read_one(p)


def _read_one(p: Path) -> Captured:
    mf = p / MANIFEST
    manifest = read_manifest(mf)
    files = set(manifest["files"])
    batches = _load(p, BATCHES_FILE)
    _budget_left_out(p, manifest, batches)
    validate_batches(batches, p / BATCHES_FILE)
    batches = [_batch(b, p / BATCHES_FILE, i) for i, b in enumerate(batches)]
    steps = [int(s) for s in manifest["batch_steps"]]
    step = int(manifest["step"])
    if len(steps) != len(batches):
        raise CaptureError(f"{p}: batches.pt holds {len(batches)} batch(es) but {MANIFEST} field batch_steps names "
                           f"{len(steps)}; the capture is inconsistent (capture again)")
    rng = _load(p, RNG_FILE) if RNG_FILE in files and (p / RNG_FILE).is_file() else None
    rng = rng if isinstance(rng, dict) else None
    ring = read_ring(p, sorted(files))
    if capture_ref.REFERENCE in manifest:  # by reference: the run's own checkpoint holds the state (capture.reference)
        model, opt, scaler, at = capture_ref.start_state(p, manifest)
        return Captured(p, manifest, model, StartState(opt, scaler, at), batches, from_snapshot=True, rng=rng, ring=ring)
    if STATE_FILE in files:
        st = _load(p, STATE_FILE)
        validate_state(st, p / STATE_FILE)
        return Captured(p, manifest, st["model"], StartState(st.get("optimizer"), st.get("scaler"), step),
                        [batches[-1]], from_snapshot=False, rng=rng, ring=ring)
    if SNAPSHOT_FILE in files:
        snap = manifest.get("snapshot_step")
        snap_step = int(snap) if snap is not None else steps[0]
        if steps[0] != snap_step:
            raise CaptureError(f"{p}: the batches since the snapshot (step {snap_step}) were left out; "
                               "it cannot re-reach the failing step (raise capture_max_bytes)")
        st = _load(p, SNAPSHOT_FILE)
        validate_state(st, p / SNAPSHOT_FILE)
        return Captured(p, manifest, st["model"], StartState(st.get("optimizer"), st.get("scaler"), snap_step),
                        batches, from_snapshot=True, rng=rng, ring=ring)
    raise CaptureError(f"{p}: neither state.pt nor snapshot.pt; the capture holds no weights to start from")


def _budget_left_out(p: Path, manifest: dict[str, Any], batches: Any) -> None:
    """No batch because ``capture_max_bytes`` left them all out: say so, and by how much (the manifest's
    ``left_out``), not that the run gave none."""
    if isinstance(batches, list) and batches:
        return
    why = next((x for x in manifest.get("left_out") or [] if isinstance(x, str) and "capture_max_bytes=" in x
                and " batches (" in x), None)
    if why is not None:
        raise CaptureError(f"{p}: the capture holds no batch to replay: the capture budget left out {why}; capture "
                           "again with a larger Monitor(capture_max_bytes=...)")


def _batch(b: Any, where: Path, i: int) -> Any:
    """A stored batch back into what the stages run: an accumulated step's micro-batches (``Micro``), a
    call of the model taken without ``batch=`` (``ModelInputs``), else the batch as the loader yielded it."""
    if isinstance(b, dict) and set(b) == {MICRO_KEY}:
        if not isinstance(b[MICRO_KEY], list) or not b[MICRO_KEY]:
            raise CaptureError(f"{where}: batch {i} ({MICRO_KEY}) holds no list of micro-batches; the capture is damaged")
        return Micro([_batch(m, where, i) for m in b[MICRO_KEY]])
    if isinstance(b, dict) and set(b) == {MODEL_INPUTS_KEY}:
        call = b[MODEL_INPUTS_KEY]
        if not (isinstance(call, dict) and isinstance(call.get("args"), (list, tuple)) and isinstance(call.get("kwargs"), dict)):
            raise CaptureError(f"{where}: batch {i} ({MODEL_INPUTS_KEY}) is not {{'args': [...], 'kwargs': {{...}}}}; "
                               "the capture is damaged")
        return ModelInputs(tuple(call["args"]), dict(call["kwargs"]))
    return b


__all__ = ["Captured", "read_rank"]
