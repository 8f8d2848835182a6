"""Read a capture folder (``Monitor(capture=...)``) into the state triage replays from.

The spec builds the architecture (``build_model``, ``build_optimizer``); the weights, optimizer
state, GradScaler state and batches come from the capture. The replay starts from the state before
the failing step when the capture has it (``state.pt``: the step was skipped, so nothing was
applied) and runs the failing batch alone; otherwise from the last periodic snapshot through every
batch since, the failing one last. Errors are one line (``CaptureError``), never a traceback.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.engine.capture import MANIFEST, MICRO_KEY, MODEL_INPUTS_KEY
from ampdoctor.engine.shards import ENGINES, assemble
from ampdoctor.errors import CaptureError
from ampdoctor.input.batches import Micro, ModelInputs
from ampdoctor.input.capture_schema import (
    BATCHES_FILE,
    RNG_FILE,
    SNAPSHOT_FILE,
    STATE_FILE,
    read_manifest,
    read_ring,
    validate_batches,
    validate_state,
)
from ampdoctor.input.resume import StartState
from ampdoctor.watch.hooks import unwrap


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
    """The lookback ring's tables (steps, layers) as DataFrames (``input.capture_schema.read_ring``), or None."""

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
        """The run's own precision: amp | bf16 | fp32 (what the Monitor saw)."""
        p = str(self.manifest.get("precision", "amp"))
        return p if p in ("amp", "bf16", "fp32") else "amp"


def _load(path: Path, name: str) -> Any:
    f = path / name
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CaptureError(f"{path}: {name} is missing; the capture is incomplete (capture again)") from None
    except Exception as e:
        raise CaptureError(f"{path}: {name} cannot be read ({type(e).__name__}: {str(e).strip().splitlines()[0][:160]}); "
                           "the file is truncated or not an ampdoctor capture") from None


def read_capture(path: str | Path) -> Captured:
    """Read and check a capture folder; raise CaptureError (one line) saying what is wrong.

    Every manifest field is validated against ``ampdoctor/schema/capture.schema.json`` and every tensor
    file's layout (``input.capture_schema``) before anything is used: a capture is a file users mail to
    each other, and a damaged one is one line naming the file and the field."""
    p = Path(path)
    group = rank_captures(p)
    if group:
        return _assemble(p, group)
    if not p.is_dir():
        raise CaptureError(f"{p}: no such capture folder; pass the folder Monitor(capture=...) wrote")
    mf = p / MANIFEST
    if not mf.exists():
        raise CaptureError(f"{p}: no {MANIFEST}; this is not an ampdoctor capture folder")
    return _read_one(p)


def _read_one(p: Path) -> Captured:
    mf = p / MANIFEST
    manifest = read_manifest(mf)
    files = set(manifest["files"])
    batches = _load(p, BATCHES_FILE)
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


_RANK = re.compile(r"^(.*)\.rank(\d+)$")


def rank_captures(p: Path) -> dict[int, Path]:
    """The per-rank capture folders of one sharded run's step: ``cap.rank0``, ``cap.rank1``... next to ``p``
    (``p`` itself one of them, or the ``capture=`` name the run was given), when ``p`` names a sharded capture;
    else empty (a whole model's capture is read alone)."""
    m = _RANK.match(p.name)
    base = m.group(1) if m else p.name
    if m and not (p / MANIFEST).is_file():
        return {}
    if not m and p.is_dir():
        return {}
    found = {int(mm.group(2)): q for q in sorted(p.parent.glob(f"{glob.escape(base)}.rank*"))
             if (mm := _RANK.match(q.name)) is not None and mm.group(1) == base and (q / MANIFEST).is_file()}
    one = p / MANIFEST if m else (next(iter(found.values())) / MANIFEST if found else None)
    if one is None:
        return {}
    own = read_manifest(one)
    if own.get("sharded") not in ENGINES or not own.get("shards"):  # (DeepSpeed's: engine.shard_capture)
        return {}
    return found


def _assemble(p: Path, group: dict[int, Path]) -> Captured:
    """One process's view of a sharded step: every rank's shard of the state put back into whole tensors (by the
    layouts their manifests hold), the batch, RNG and scaler of the rank that went first."""
    caps: dict[int, Captured] = {}
    for r, q in sorted(group.items()):
        caps[r] = _read_one(q)
    first = next(iter(caps.values()))
    step, world, engine = first.step, int(first.manifest.get("world_size") or 1), first.manifest.get("sharded")
    same = {r: c for r, c in caps.items() if c.step == step and c.manifest.get("sharded") == engine}
    missing = [r for r in range(world) if r not in same]
    if missing or not engine:
        raise CaptureError(f"{p}: a sharded capture is replayed from every rank's shard of the step; rank(s) "
                           f"{', '.join(map(str, missing)) or '?'} of {world} have none next to it (copy every "
                           f"cap.rankN folder of step {step} together)")
    if len({c.from_snapshot for c in same.values()}) > 1 or len({c.start.step0 for c in same.values()}) > 1:
        raise CaptureError(f"{p}: the ranks' captures of step {step} start from different states (state.pt on some, "
                           "snapshot.pt on others); capture again")
    named = _RANK.match(p.name)
    want = same[0].manifest.get("first_rank")
    lead = int(want) if isinstance(want, int) and want in same else (int(named.group(2)) if named else 0)
    lead_cap = same[lead]
    layouts = {r: c.manifest["shards"]["model"] for r, c in same.items()}
    try:
        model = {k: assemble([(same[r].model[k], layouts[r][k]) for r in sorted(same)], k) for k in layouts[lead]}
        opt = _assemble_optimizer(same, layouts)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CaptureError(f"{p}: the ranks' shards do not fit together ({type(e).__name__}: {str(e)[:160]}); "
                           "capture again") from None
    said = (f"reassembled the whole model from the {world} ranks' shards ({engine}) of step {step} on one process; "
            f"replayed rank {lead}'s batch")
    return Captured(lead_cap.path, lead_cap.manifest, model, StartState(opt, lead_cap.start.scaler, lead_cap.start.step0),
                    lead_cap.batches, lead_cap.from_snapshot, rng=lead_cap.rng, assembled=said)


def _assemble_optimizer(caps: dict[int, Captured], layouts: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    ranks = sorted(caps)
    states = {r: caps[r].start.optimizer for r in ranks}
    if any(s is None for s in states.values()):
        return None
    lead = states[ranks[0]]
    assert lead is not None
    names = caps[ranks[0]].manifest["shards"].get("optimizer_params") or []
    out_state: dict[Any, Any] = {}
    keys = {k for s in states.values() if s is not None for k in s.get("state", {})}
    for idx in sorted(keys, key=lambda k: int(k)):
        name = names[int(idx)] if int(idx) < len(names) else None
        have = [r for r in ranks if idx in states[r]["state"]]  # type: ignore[index]
        entry: dict[str, Any] = {}
        for k, v in states[have[0]]["state"][idx].items():  # type: ignore[index]
            if name is not None and isinstance(v, torch.Tensor) and v.dim() > 0 and name in caps[have[0]].model and \
                    tuple(v.shape) == tuple(caps[have[0]].model[name].shape):
                pieces = [(states[r]["state"][idx][k], layouts[r][name]) for r in have]  # type: ignore[index]
                entry[k] = assemble(pieces, f"optimizer state {k} of {name}")
            else:
                entry[k] = v
        out_state[idx] = entry
    return {"state": out_state, "param_groups": lead["param_groups"]}


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
        named = dict(unwrap(model).named_parameters())
        built = [{"params": [named[n] for n in g["params"] if n in named],
                  **{k: tuple(v) if isinstance(v, list) else v for k, v in g["hyper"].items()}} for g in groups]
        return cls(built)  # type: ignore[call-arg]

    return build_optimizer
