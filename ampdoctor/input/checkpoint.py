"""Read a training checkpoint into (model, optimizer, scaler) state, whatever layout the run saved.

Layouts, detected from what is there (never from a file name alone):

- ``dict``: a ``torch.save`` file holding a dict with model / optimizer / scaler entries, as PyTorch's AMP
  recipe saves it (``{"model": ..., "optimizer": ..., "scaler": ...}`` and the usual spellings), or a bare
  ``state_dict``; a ``.safetensors`` file is a bare state_dict too;
- ``transformers``: a Trainer checkpoint folder (``checkpoint-500/``): ``model.safetensors`` or
  ``pytorch_model.bin`` (or their sharded ``*.index.json``), ``optimizer.pt``, ``scaler.pt``,
  ``rng_state.pth``, ``trainer_state.json``;
- ``lightning``: a Lightning ``.ckpt`` (``state_dict``, ``optimizer_states``, ``global_step``, the AMP scaler
  under the precision plugin's class name, ``MixedPrecision`` in 2.x, ``native_amp_scaling_state`` in 1.x);
- ``spec``: anything else, read by the spec's ``load_checkpoint(model, optimizer, scaler, path)``.

Every file is loaded with ``torch.load(weights_only=True)`` (numpy arrays and scalars allowed, as
transformers does for its RNG file); pickled Python objects are refused with a message naming them,
and loaded only when the caller passes ``trust=True``.
"""

from __future__ import annotations

import json
import pickle
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ampdoctor.errors import CaptureError, CheckpointError

Layout = str
"""'dict' | 'transformers' | 'lightning' | 'spec'."""

LoadCheckpoint = Callable[[Any, Any, Any, Path], Any]
"""The spec's ``load_checkpoint(model, optimizer, scaler, path)``; it may return the run's step (an int)."""

MODEL_KEYS = ("model", "model_state_dict", "state_dict", "model_state", "net", "module")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt", "optimizer_state")
SCALER_KEYS = ("scaler", "scaler_state_dict", "grad_scaler", "amp_scaler", "scaler_state")
STEP_KEYS = ("step", "global_step", "iter_num", "iteration", "iter", "it", "num_updates")
RNG_KEYS = ("rng", "rng_state", "rng_states")
RNG_ENTRIES = {"torch_rng_state": "cpu", "cpu_rng_state": "cpu", "cuda_rng_state": "cuda", "numpy_rng_state": "numpy", "python_rng_state": "python"}
LIGHTNING_SCALER_KEYS = ("MixedPrecision", "native_amp_scaling_state")

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
TRAINER_STATE = "trainer_state.json"

TRUST_HINT = ("re-save just the state_dicts (torch.save({'model': model.state_dict(), 'optimizer': opt.state_dict(), "
              "'scaler': scaler.state_dict()}, path)), or, only if you trust where it came from, load it yourself in the "
              "spec's load_checkpoint(model, optimizer, scaler, path) with torch.load(path, weights_only=False)")


@dataclass
class CheckpointState:
    """What a checkpoint holds, in the forms ``load_state_dict`` takes."""

    model: dict[str, torch.Tensor]
    """A state_dict for ``model.load_state_dict``; keys mapped to the model's when a model was given."""
    optimizer: dict[str, Any] | None
    """``optimizer.state_dict()``, or None when the checkpoint has none."""
    scaler: dict[str, Any] | None
    """``GradScaler.state_dict()``, or None when the checkpoint has none (or the scaler was disabled)."""
    step: int | None
    """The run's global step when the checkpoint records it."""
    rng: dict[str, Any] | None
    """RNG states when the layout has them (transformers: python, numpy, cpu, cuda)."""
    layout: Layout
    source: Path
    notes: list[str] = field(default_factory=list)
    """What was found but not used, or read with an assumption: one sentence each, for the report."""

    @property
    def kind(self) -> str:
        """What it is, in the words of a message: 'checkpoint' (``input.resume.Saved``)."""
        return "checkpoint"

    @property
    def next_step(self) -> int | None:
        """The run's number of the first step after this checkpoint, as the framework's own log numbers it:
        a Trainer folder's ``global_step + 1`` (the Trainer gives a step its global_step after it, and saves
        ``checkpoint-N`` after its step N), a Lightning ``.ckpt``'s ``global_step`` (its loggers give a step
        the global step while it runs), and a dict's or a spec's step as saved."""
        if self.step is None:
            return None
        return self.step + 1 if self.layout == "transformers" else self.step


# ---------------------------------------------------------------------------------------------- loading


def _numpy_safe_globals() -> list[Any]:
    """numpy arrays, dtypes and scalars: plain data, allowed as transformers allows them for rng_state.pth."""
    core = getattr(np, "_core", None) or np.core
    allowed: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    allowed += sorted({type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.int32, np.bool_)}, key=str)
    return allowed


def _sniff(path: Path) -> str:
    """'zip' (torch.save), 'pickle' (legacy torch.save), 'safetensors' or 'unknown', from the first bytes."""
    with path.open("rb") as f:
        head = f.read(16)
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head[:1] == b"\x80":
        return "pickle"
    if len(head) > 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 1:
        return "safetensors"
    return "unknown"


def _unsafe_globals(path: Path) -> list[str]:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:
        return []
    numpy_ok = {f"{g.__module__}.{g.__qualname__}" for g in _numpy_safe_globals()}
    return [n for n in names if n not in numpy_ok]


def _short(items: Iterable[str], n: int = 4) -> str:
    items = list(items)
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def load_file(path: Path, *, trust: bool = False, what: str | None = None) -> Any:
    """``torch.load`` one file on the CPU, weights only; raise CheckpointError in one line on failure."""
    what = what or str(path)
    kind = _sniff(path)
    if kind == "safetensors":
        return _load_safetensors(path)
    if kind == "unknown":
        with path.open("rb") as f:
            head = f.read(8)
        raise CheckpointError(f"{what}: not a PyTorch or safetensors checkpoint (it starts with {head!r}); pass the file torch.save wrote")
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        names = _unsafe_globals(path) or re.findall(r"GLOBAL ([\w.]+)", str(e))
        if not names:  # not a refusal: the pickle itself is broken
            raise CheckpointError(f"{what}: truncated or corrupt ({first_line(e)}); the save was probably interrupted: use an earlier checkpoint") from None
        if trust:
            return _load_trusted(path, what)
        raise CheckpointError(f"{what}: holds pickled Python objects that weights-only loading refuses ({_short(names)}); {TRUST_HINT}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{what}: truncated or corrupt ({first_line(e)}); the save was probably interrupted: use an earlier checkpoint") from None


def _load_trusted(path: Path, what: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"{what}: cannot be unpickled even with trust=True ({type(e).__name__}: {first_line(e)}); import the classes it needs first, or re-save just the state_dicts") from None


def first_line(e: BaseException) -> str:
    """The exception's first sentence, without terminal colours: it goes inside a one-line message."""
    text = str(e).strip().splitlines()
    line = re.sub(r"\x1b\[[0-9;]*m", "", text[0]) if text else type(e).__name__
    return line.split(". ")[0].rstrip(".")[:160]


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file as st_load
    except ImportError:
        raise CheckpointError(f"{path}: a safetensors file, and the safetensors package is not installed; pip install safetensors") from None
    try:
        return dict(st_load(str(path), device="cpu"))
    except Exception as e:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({first_line(e)}); use an earlier checkpoint") from None


# ---------------------------------------------------------------------------------------------- shapes


def _is_tensor_map(x: Any) -> bool:
    return isinstance(x, Mapping) and len(x) > 0 and all(isinstance(k, str) for k in x) and any(isinstance(v, torch.Tensor) for v in x.values())


def _tensors_only(x: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in x.items() if isinstance(v, torch.Tensor)}


def _is_bare_state_dict(x: Any) -> bool:
    if not _is_tensor_map(x):
        return False
    return all(isinstance(v, torch.Tensor) or k.endswith("_extra_state") for k, v in x.items())


def _is_optimizer_state(x: Any) -> bool:
    return isinstance(x, Mapping) and "state" in x and "param_groups" in x


def _is_scaler_state(x: Any) -> bool:
    return isinstance(x, Mapping) and "scale" in x and ("_growth_tracker" in x or "growth_factor" in x)


def _as_int(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point():
        return int(x.item())
    if isinstance(x, np.integer):
        return int(x)
    return None


def _model_entry(value: Any) -> dict[str, torch.Tensor] | None:
    if isinstance(value, torch.nn.Module):  # only reachable with trust=True
        return dict(value.state_dict())
    if _is_tensor_map(value):
        return _tensors_only(value)
    return None


# ---------------------------------------------------------------------------------------------- layouts


def _from_dict(obj: Any, source: Path) -> CheckpointState:
    """A torch.save'd object: a Lightning checkpoint, a dict with entries, or a bare state_dict."""
    if isinstance(obj, torch.nn.Module):  # a whole pickled model (trust=True)
        return CheckpointState(dict(obj.state_dict()), None, None, None, None, "dict", source, ["the file is a whole pickled model"])
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{source}: holds a {type(obj).__name__}, not a dict of state_dicts; save {{'model': model.state_dict(), ...}} or pass a spec load_checkpoint(model, optimizer, scaler, path)")
    if _is_bare_state_dict(obj):
        return CheckpointState(_tensors_only(obj), None, None, None, None, "dict", source, ["a bare state_dict: no optimizer, scaler or step"])
    if "state_dict" in obj and ("optimizer_states" in obj or "pytorch-lightning_version" in obj or "loops" in obj):
        return _from_lightning(obj, source)
    return _from_entries(obj, source)


def _first_key(obj: Mapping[str, Any], keys: Iterable[str], test: Callable[[Any], bool]) -> str | None:
    for k in keys:
        if k in obj and test(obj[k]):
            return k
    return None


def _scaler_from(obj: Mapping[str, Any], keys: Iterable[str], notes: list[str]) -> dict[str, Any] | None:
    for k in keys:
        if k in obj:
            v = obj[k]
            if _is_scaler_state(v):
                return dict(v)
            if isinstance(v, Mapping) and not v:
                notes.append(f"'{k}' is empty: the GradScaler was disabled when it was saved")
                return None
    for k, v in obj.items():  # any entry shaped like GradScaler.state_dict(), whatever its name
        if _is_scaler_state(v):
            notes.append(f"the scaler state is under '{k}'")
            return dict(v)
    return None


def _step_from(obj: Mapping[str, Any], notes: list[str]) -> int | None:
    for k in STEP_KEYS:
        if k in obj and (s := _as_int(obj[k])) is not None:
            return s
    if "epoch" in obj:
        notes.append(f"epoch {obj['epoch']} but no step count ({', '.join(STEP_KEYS[:3])})")
    return None


def _from_entries(obj: Mapping[str, Any], source: Path) -> CheckpointState:
    notes: list[str] = []
    mkey = _first_key(obj, MODEL_KEYS, lambda v: _model_entry(v) is not None)
    if mkey is None:
        keys = _short([str(k) for k in obj], 6)
        raise CheckpointError(
            f"{source}: a dict with keys {keys} but no model weights (looked for {', '.join(MODEL_KEYS[:3])}); "
            "pass a spec load_checkpoint(model, optimizer, scaler, path) that reads it"
        )
    model = _model_entry(obj[mkey])
    assert model is not None
    okey = _first_key(obj, OPTIMIZER_KEYS, _is_optimizer_state)
    optimizer = dict(obj[okey]) if okey else None
    if okey is None and any(k in obj for k in OPTIMIZER_KEYS):
        notes.append("an optimizer entry that is not an optimizer.state_dict(); ignored")
    scaler = _scaler_from(obj, SCALER_KEYS, notes)
    return CheckpointState(model, optimizer, scaler, _step_from(obj, notes), _rng_from(obj), "dict", source, notes)


def _rng_from(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """A dict of RNG states (``rng_state``...), one tensor (``torch.get_rng_state()``), or separate entries."""
    for k in RNG_KEYS:
        v = obj.get(k)
        if isinstance(v, Mapping):
            return dict(v)
        if isinstance(v, torch.Tensor):
            return {"cpu": v}
    found = {name: obj[k] for k, name in RNG_ENTRIES.items() if k in obj}
    return found or None


def _from_lightning(obj: Mapping[str, Any], source: Path) -> CheckpointState:
    notes: list[str] = []
    model = _model_entry(obj["state_dict"])
    if model is None:
        raise CheckpointError(f"{source}: a Lightning checkpoint whose state_dict holds no tensors; save it with trainer.save_checkpoint()")
    states = obj.get("optimizer_states") or []
    optimizer = dict(states[0]) if states and _is_optimizer_state(states[0]) else None
    if len(states) > 1:
        notes.append(f"{len(states)} optimizers in optimizer_states; used the first")
    if not states:
        notes.append("no optimizer_states (saved with weights_only=True?)")
    scaler = _scaler_from(obj, LIGHTNING_SCALER_KEYS, notes)
    step = _as_int(obj.get("global_step"))
    return CheckpointState(model, optimizer, scaler, step, None, "lightning", source, notes)


def _describe_folder(path: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    return _short(names, 6) if names else "nothing"


def _checkpoint_subfolders(path: Path) -> list[Path]:
    subs = [p for p in path.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return sorted(subs, key=lambda p: int(p.name.split("-")[1]))


def _load_index(folder: Path, index_name: str, trust: bool) -> dict[str, torch.Tensor]:
    index = folder / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a weights index with a weight_map ({type(e).__name__}: {e}); the save was probably interrupted") from None
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise CheckpointError(f"{folder}/: {index_name} lists {len(shards)} shards but {_short(missing, 3)} is missing; copy the whole checkpoint folder")
    out: dict[str, torch.Tensor] = {}
    for s in shards:
        part = load_file(folder / s, trust=trust)
        if not _is_tensor_map(part):
            raise CheckpointError(f"{folder / s}: a weights shard that holds no tensors; copy the whole checkpoint folder")
        out.update(_tensors_only(part))
    absent = [k for k in weight_map if k not in out]
    if absent:
        raise CheckpointError(f"{folder}/: {index_name} names {_short(absent, 3)} but no shard holds it; copy the whole checkpoint folder")
    return out


def _from_folder(path: Path, trust: bool) -> CheckpointState:
    """A transformers Trainer checkpoint folder."""
    notes: list[str] = []
    if (path / SAFE_WEIGHTS).is_file():
        model = _load_safetensors(path / SAFE_WEIGHTS)
    elif (path / SAFE_INDEX).is_file():
        model = _load_index(path, SAFE_INDEX, trust)
    elif (path / BIN_WEIGHTS).is_file():
        loaded = load_file(path / BIN_WEIGHTS, trust=trust)
        if not _is_tensor_map(loaded):
            raise CheckpointError(f"{path / BIN_WEIGHTS}: holds no tensors; use an earlier checkpoint")
        model = _tensors_only(loaded)
    elif (path / BIN_INDEX).is_file():
        model = _load_index(path, BIN_INDEX, trust)
    else:
        raise CheckpointError(_no_weights_message(path))
    optimizer = None
    for name in ("optimizer.pt", "optimizer.bin"):
        if (path / name).is_file():
            loaded = load_file(path / name, trust=trust)
            optimizer = dict(loaded) if _is_optimizer_state(loaded) else None
            if optimizer is None:
                notes.append(f"{name} is not an optimizer.state_dict(); ignored")
            break
    scaler = None
    if (path / "scaler.pt").is_file():
        scaler = _scaler_from({"scaler.pt": load_file(path / "scaler.pt", trust=trust)}, ["scaler.pt"], notes)
    rng = _rng_from_folder(path, notes)
    step = _trainer_step(path, notes)
    return CheckpointState(model, optimizer, scaler, step, rng, "transformers", path, notes)


def _no_weights_message(path: Path) -> str:
    subs = _checkpoint_subfolders(path)
    if subs:
        return f"{path}/: holds {_short([s.name for s in subs], 4)}, not one checkpoint; pass one of them (the latest is {subs[-1]})"
    if not any(path.iterdir()):
        return f"{path.name}/: an empty folder; pass the checkpoint folder or file the run saved"
    found = _describe_folder(path)
    if (path / ".metadata").is_file() and any(path.glob("*.distcp")):
        return (
            f"{path.name}/: a torch.distributed.checkpoint folder ({found}); convert it to one file with "
            f"python -m torch.distributed.checkpoint.format_utils dcp_to_torch {path} ckpt.pt and pass that"
        )
    adapter = " (adapter_model.* is a PEFT adapter, not the model's weights)" if any(path.glob("adapter_model.*")) else ""
    return (
        f"{path.name}/: found {found} but no model weights ({SAFE_WEIGHTS} or {BIN_WEIGHTS}){adapter}; "
        "pass a folder the Trainer saved whole, or a spec load_checkpoint(model, optimizer, scaler, path) that reads it"
    )


def _rng_from_folder(path: Path, notes: list[str]) -> dict[str, Any] | None:
    files = sorted(path.glob("rng_state*.pth"))
    if not files:
        return None
    f = path / "rng_state.pth" if (path / "rng_state.pth").is_file() else files[0]
    if len(files) > 1:
        notes.append(f"{len(files)} RNG files (one per rank); used {f.name}")
    try:
        loaded = load_file(f)
    except CheckpointError as e:  # the RNG is optional: the weights are still usable
        notes.append(f"RNG state not read: {e}")
        return None
    return dict(loaded) if isinstance(loaded, Mapping) else None


def _trainer_step(path: Path, notes: list[str]) -> int | None:
    state = path / TRAINER_STATE
    if state.is_file():
        try:
            step = _as_int(json.loads(state.read_text()).get("global_step"))
        except (ValueError, AttributeError):
            step = None
        if step is not None:
            return step
        notes.append(f"{TRAINER_STATE} has no global_step")
    m = re.fullmatch(r"checkpoint-(\d+)", path.name)
    if m:
        notes.append(f"step {m.group(1)} taken from the folder name")
        return int(m.group(1))
    return None


def _from_spec(load: LoadCheckpoint, path: Path, model: Any, optimizer: Any, scaler: Any) -> CheckpointState:
    if model is None:
        raise CheckpointError(f"{path}: the spec's load_checkpoint needs the model; build it first and pass model=")
    try:
        result = load(model, optimizer, scaler, path)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: the spec's load_checkpoint raised {type(e).__name__}: {first_line(e)}") from None
    step = _as_int(result)
    if result is not None and step is None:
        raise CheckpointError(f"{path}: the spec's load_checkpoint returned a {type(result).__name__}; return the run's step (an int) or None")
    opt = dict(optimizer.state_dict()) if optimizer is not None else None
    sc = dict(scaler.state_dict()) if scaler is not None and scaler.is_enabled() else None
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return CheckpointState(state, opt, sc, step, None, "spec", path, [])


def read_checkpoint(
    path: str | Path,
    *,
    load_checkpoint: LoadCheckpoint | None = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    trust: bool = False,
) -> CheckpointState:
    """Read the checkpoint at ``path``; raise CheckpointError (one line) when it cannot.

    With ``load_checkpoint`` (the spec's function) it is called on ``model``, ``optimizer`` and ``scaler``
    and their state is returned. Otherwise the layout is detected from the contents. With ``model``, the
    weights' keys are mapped to the model's (a prefix stripped or added) and checked against its
    shapes, so ``model.load_state_dict(state.model)`` loads strictly.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder; pass the checkpoint the run saved")
    if load_checkpoint is not None:
        return _from_spec(load_checkpoint, p, model, optimizer, scaler)
    if p.is_dir():
        state = _from_folder(p, trust)
    else:
        if p.stat().st_size == 0:
            raise CheckpointError(f"{p}: empty file; the save was probably interrupted: use an earlier checkpoint")
        obj = load_file(p, trust=trust)
        state = _from_dict(obj, p)
    if model is not None:
        state.model, note = match_keys(model, state.model, f"{p}: ")
        if note:
            state.notes.append(note)
    return state


# ---------------------------------------------------------------------------------------------- matching

def _shape(t: torch.Tensor) -> str:
    return "x".join(str(d) for d in t.shape) or "scalar"


def _candidate_maps(ckpt: Iterable[str], want: set[str]) -> list[tuple[str, str]]:
    """(strip, add) prefix pairs worth trying: the checkpoint's leading components and the model's."""
    cands: Counter[tuple[str, str]] = Counter()
    for keys, is_ckpt in ((ckpt, True), (want, False)):
        for k in keys:
            parts = k.split(".")
            for depth in (1, 2):
                if len(parts) > depth:
                    pre = ".".join(parts[:depth]) + "."
                    cands[(pre, "") if is_ckpt else ("", pre)] += 1
    return [c for c, _ in cands.most_common(64)]


def _apply(ckpt: Mapping[str, torch.Tensor], strip: str, add: str) -> dict[str, torch.Tensor]:
    return {add + k[len(strip):]: v for k, v in ckpt.items() if k.startswith(strip)}


def _tied_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each state_dict key, the other keys that name the same tensor (tied weights)."""
    by_id: defaultdict[int, list[str]] = defaultdict(list)
    for k, v in model.state_dict(keep_vars=True).items():
        by_id[id(v)].append(k)
    return {k: [o for o in group if o != k] for group in by_id.values() for k in group}


def match_keys(model: torch.nn.Module, ckpt: Mapping[str, torch.Tensor], source: str = "",
               noun: str = "checkpoint") -> tuple[dict[str, torch.Tensor], str]:
    """Saved weights keyed as ``model`` expects, so ``load_state_dict`` loads strictly; also a sentence saying
    which prefix was stripped or added, if any.

    A common prefix is stripped (Lightning's ``model.``, DDP's ``module.``, ``torch.compile``'s
    ``_orig_mod.``) or added when that makes the keys fit; a key left out because it is tied to another
    (transformers drops ``lm_head.weight``) is filled from its twin. Otherwise raise CheckpointError (a
    ``noun`` other than "checkpoint": CaptureError), after ``source``, naming the first missing, unexpected
    and mismatched keys.
    """
    want = dict(model.state_dict())
    tied = _tied_groups(model)
    best = (dict(ckpt), "", "")
    best_hits = sum(k in want for k in ckpt)
    if best_hits < len(want):
        for strip, add in _candidate_maps(ckpt, set(want)):
            mapped = _apply(ckpt, strip, add)
            hits = sum(k in want for k in mapped)
            if hits > best_hits:
                best, best_hits = (mapped, strip, add), hits
    mapped, strip, add = best
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for k in want:
        if k in mapped:
            out[k] = mapped[k]
            continue
        twin = next((t for t in tied.get(k, []) if t in mapped), None)
        if twin is None:
            missing.append(k)
        else:
            out[k] = mapped[twin]
    unexpected = [k for k in mapped if k not in want]
    wrong = [k for k in out if tuple(out[k].shape) != tuple(want[k].shape)]
    if missing or wrong or unexpected:
        error = CheckpointError if noun == "checkpoint" else CaptureError
        raise error(source + _mismatch_message(missing, unexpected, wrong, out, want, strip, add, noun))
    if not (strip or add):
        return out, ""
    what = f"stripped the prefix '{strip}'" if strip else f"added the prefix '{add}'"
    outside = [k for k in ckpt if not k.startswith(strip)]
    rest = f"; left out {len(outside)} keys outside it ({_short(outside, 3)})" if outside else ""
    return out, f"{what} to fit the model's keys{rest}"


def _mismatch_message(
    missing: list[str], unexpected: list[str], wrong: list[str], out: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], strip: str, add: str,
    noun: str,
) -> str:
    parts = []
    if missing:
        parts.append(f"the model has {_short(missing, 3)} that the {noun} lacks")
    if unexpected:
        parts.append(f"the {noun} has {_short(unexpected, 3)} that the model lacks")
    if wrong:
        k = wrong[0]
        more = f" (+{len(wrong) - 1} more shapes differ)" if len(wrong) > 1 else ""
        parts.append(f"{k} is {_shape(out[k])} in the {noun}, {_shape(want[k])} in the model{more}")
    mapping = f" (after stripping '{strip}')" if strip else f" (after adding '{add}')" if add else ""
    return f"the {noun} is from another model{mapping}: {'; '.join(parts)}; build_model() must build the architecture the run trained"


def match_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Raise CheckpointError when the optimizer state's groups do not fit ``optimizer`` (load_state_dict would)."""
    have = [len(g["params"]) for g in state.get("param_groups", [])]
    want = [len(g["params"]) for g in optimizer.param_groups]
    if have != want:
        raise CheckpointError(
            f"the optimizer state has {len(have)} parameter groups of {have} parameters, build_optimizer() makes "
            f"{len(want)} of {want}; build the optimizer the run used (same groups, same order)"
        )
