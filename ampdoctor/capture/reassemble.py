"""The one reader of a sharded step's per-rank captures (FSDP1, FSDP2, tensor parallelism, DeepSpeed ZeRO).

Under a sharding engine each rank writes its own capture folder (``cap.rank0``, ``cap.rank1`` ...), with no
collective: its ``state.pt`` / ``snapshot.pt`` hold this rank's piece of each tensor (plain tensors, no
engine class), and the manifest's ``sharded`` names the engine and ``shards`` says where each piece sits in
the whole tensor (plain JSON)::

    "sharded": "fsdp2",
    "shards": {"model": {"embed.weight": {"shape": [32, 8], "offset": [16, 0]},
                         "head.weight": {"shape": [1, 6], "offset": [1, 0]}, ...},
               "optimizer_params": ["embed.weight", "embed.bias", ...],
               "recipe": {"engine": "fsdp2", "fully_shard": ["head", "mid", "embed", ""], "mesh": [2],
                          "mp_policy": {"param_dtype": "float16", ...}}}

A piece is either ``{"shape": [...], "offset": [...]}``, a block at that offset (a DTensor's shard under FSDP2
or tensor parallelism; a replica or a plain tensor: the whole tensor at 0), or ``{"shape": [...], "flat": k}``,
elements ``k ..`` of the flattened tensor (a ZeRO partition's fragment, FSDP1's slice of a flat parameter). A
rank may hold an empty piece. The optimizer state's entry ``i`` belongs to the parameter
``optimizer_params[i]``; its tensors shaped like that rank's piece of the parameter are pieces laid out as
it, the rest (a step count) are taken from the first rank that has the entry. ``recipe`` (FSDP2 only) is how
the model was sharded, for ``triage --from --nproc N`` (``engine.shard_replay``).

``reassemble_group`` reads every rank's folder of the same step, checks that they belong together (rank,
step, world size, engine, starting state) and returns one ``Captured``: the whole model and optimizer state,
and the batches, RNG and scaler state of the rank that went first (the manifest's ``first_rank``, else the
rank whose folder was named). Reading imports no engine: a sharded capture is triaged where DeepSpeed or FSDP
are not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ampdoctor.capture.folder import Captured, read_rank
from ampdoctor.capture.rank_folders import RANK_FOLDER, group_of
from ampdoctor.capture.schema import MANIFEST, SNAPSHOT_FILE, STATE_FILE, read_manifest, validate_state
from ampdoctor.errors import CaptureError
from ampdoctor.input.resume import StartState
from ampdoctor.parallel.pieces import assemble, claimed_shape
from ampdoctor.parallel.registry import named as engine_named


def _layout(cap: Captured) -> tuple[dict[str, Any], list[str | None]]:
    return _layout_of(cap.manifest, cap.path)


def _layout_of(manifest: dict[str, Any], path: Path) -> tuple[dict[str, Any], list[str | None]]:
    sh = manifest.get("shards")
    if not isinstance(sh, dict) or not isinstance(sh.get("model"), dict):
        raise CaptureError(f"{path}: this capture holds rank {manifest.get('rank')}'s shard of a "
                           f"{manifest.get('sharded')} model but its manifest has no field shards (where each piece "
                           "sits); it cannot be reassembled: capture again with this ampdoctor")
    for n, lay in sh["model"].items():
        if not (isinstance(lay, dict) and isinstance(lay.get("shape"), list)
                and (isinstance(lay.get("flat"), int) or isinstance(lay.get("offset"), list))):
            raise CaptureError(f"{path}: field shards.model[{n!r}] is not {{'shape': [...], 'flat': k}} or "
                               "{'shape': [...], 'offset': [...]}; the capture is damaged (capture again)")
    params = sh.get("optimizer_params") or []
    if not isinstance(params, list) or not all(isinstance(x, str) or x is None for x in params):
        raise CaptureError(f"{path}: field shards.optimizer_params is not a list of parameter names; the capture is damaged")
    return sh["model"], params


def check_pieces(p: Path, group: dict[int, Path]) -> None:
    """Before a replay on N processes starts: every rank's folder is of the same run, and each piece of its state
    file sits inside the whole shape its manifest names, the pieces holding at least that many elements (the state
    files memory-mapped: their shapes are read, not their data). One ``CaptureError`` line naming the tensor, the
    folder, the file and the field."""
    ms = {r: read_manifest(q / MANIFEST) for r, q in sorted(group.items())}
    r0 = min(ms)
    for r, q in group.items():
        _same_run(q, ms[r], group[r0], ms[r0])
    models: dict[int, tuple[dict[str, Any], dict[str, Any], str]] = {}
    for r, q in sorted(group.items()):
        name = STATE_FILE if STATE_FILE in ms[r]["files"] else SNAPSHOT_FILE
        try:
            st = torch.load(q / name, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CaptureError(f"{q}: {name} cannot be read ({type(e).__name__}: {str(e).strip()[:120]}); the capture is "
                               "truncated or damaged") from None
        validate_state(st, q / name)
        models[r] = (st["model"], _layout_of(ms[r], q)[0], name)
    for n in models[r0][1]:
        pieces, where = [], []
        for r, (state, lay, fname) in sorted(models.items()):
            if n not in state or n not in lay:
                raise CaptureError(f"{group[r]}: {fname} holds no piece of {n} (field shards.model[{n!r}] of "
                                   f"{group[r0].name} names it); the ranks' captures do not belong together")
            pieces.append((state[n], lay[n]))
            where.append(f"{group[r].name}/{MANIFEST}")
        try:
            claimed_shape(pieces, n, where, n)
        except ValueError as e:
            raise CaptureError(f"{p}: {e}; the capture is damaged or was edited (capture again)") from None


def _read_all(p: Path, group: dict[int, Path], m: dict[str, Any]) -> list[Captured]:
    """Every rank's capture, rank 0 first, checked to be the same step of the same run."""
    world = int(m.get("world_size") or 1)
    named = RANK_FOLDER.match(p.name)
    base = named.group("base") if named else p.name
    caps: list[Captured] = []
    for r in range(world):
        q = group.get(r)
        if q is None:
            raise CaptureError(f"{p}: rank {r}'s capture {base}.rank{r} is not beside it; the {world} ranks' captures of "
                               f"step {m.get('step')} together hold the model (copy every {base}.rank* folder)")
        c = read_rank(q)
        cm = c.manifest
        if (int(cm.get("rank") or 0), cm.get("step"), cm.get("world_size"), cm.get("sharded")) != (
                r, m.get("step"), m.get("world_size"), m.get("sharded")):
            raise CaptureError(f"{q}: not rank {r}'s capture of the same {m.get('sharded')} step {m.get('step')} "
                               f"(it holds rank {cm.get('rank')}'s step {cm.get('step')} of {cm.get('world_size')})")
        _same_run(q, cm, p, m)
        if caps and (c.from_snapshot != caps[0].from_snapshot or c.start.step0 != caps[0].start.step0):
            raise CaptureError(f"{q}: rank {r}'s capture starts from step {c.start.step0}, rank 0's from "
                               f"{caps[0].start.step0}; the ranks' captures do not belong together (capture again)")
        caps.append(c)
    return caps


def _same_run(q: Path, cm: dict[str, Any], p: Path, m: dict[str, Any]) -> None:
    """CaptureError naming both folders when ``q`` (a rank's capture) is not of the run and model ``p``'s is."""
    for key, what in (("run_id", "run id"), ("model_fingerprint", "model fingerprint")):
        if cm.get(key) != m.get(key):
            raise CaptureError(f"{q} and {p} are captures of different runs ({what} {cm.get(key)} and {m.get(key)}), "
                               f"not one step's shards: put the rank folders of one run together (each manifest.json "
                               "says its run_id)")


def reassemble_group(p: Path, group: dict[int, Path]) -> Captured:
    """One process's view of a sharded step (see the module): raises ``CaptureError`` (one line)."""
    given = group.get(int(RANK_FOLDER.match(p.name).group("rank"))) if RANK_FOLDER.match(p.name) else None  # type: ignore[union-attr]
    m = read_manifest((given or group.get(0) or next(iter(group.values()))) / MANIFEST)
    caps = _read_all(p, group, m)
    layouts = [_layout(c) for c in caps]
    want = caps[0].manifest.get("first_rank")
    named = RANK_FOLDER.match(p.name)
    lead = int(want) if isinstance(want, int) and 0 <= want < len(caps) else (int(named.group("rank")) if named else 0)
    lead = lead if lead < len(caps) else 0
    model: dict[str, torch.Tensor] = {}
    eng = engine_named(str(m.get("sharded")))
    join = eng.assemble if eng is not None else assemble  # (the engine's own, where it has other pieces)
    try:
        for n in layouts[lead][0]:
            pieces = []
            for c, (lay, _) in zip(caps, layouts, strict=True):
                if n not in c.model or n not in lay:
                    where = "state file" if n not in c.model else f"{MANIFEST} field shards.model"
                    raise ValueError(f"{n}: {c.path.name}'s {where} has no piece of it (rank "
                                     f"{caps[lead].manifest.get('rank')}'s field shards.model names it)")
                pieces.append((c.model[n], lay[n]))
            model[n] = join(pieces, n, [f"{c.path.name}/{MANIFEST}" for c in caps])
        optimizer = _optimizer(caps, layouts, join)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CaptureError(f"{p}: the ranks' pieces do not make the whole model ({e}); the captures are damaged or "
                           "from different runs (capture again)") from None
    own = caps[lead]
    engine, step = m.get("sharded"), m.get("step")
    said = (f"reassembled the whole model from the {len(caps)} ranks' shards ({engine}) of step {step} on one process; "
            f"replayed rank {lead}'s batch")
    return Captured(own.path, own.manifest, model, StartState(optimizer, own.start.scaler, own.start.step0),
                    own.batches, own.from_snapshot, rng=own.rng, assembled=said, ring=own.ring)


def reassemble(cap: Captured) -> tuple[Captured, str]:
    """``cap`` (one rank's capture) with every other rank's of its step put together: (the whole state, what was
    done in words). A capture ``read_capture`` already reassembled is returned as it is."""
    if cap.assembled is not None:
        return cap, cap.assembled
    named = RANK_FOLDER.match(cap.path.name)
    if named is None or int(named.group("rank")) != int(cap.manifest.get("rank") or 0):
        raise CaptureError(f"{cap.path}: a {cap.manifest.get('sharded')} capture of rank {cap.manifest.get('rank')} of "
                           f"{cap.manifest.get('world_size')}, but its folder is not named <name>.rank<N>, so the other "
                           "ranks' captures cannot be found beside it")
    whole = reassemble_group(cap.path, group_of(cap.path))
    assert whole.assembled is not None
    return whole, whole.assembled


def _optimizer(caps: list[Captured], layouts: list[tuple[dict[str, Any], list[str | None]]],
               join: Callable[..., torch.Tensor] = assemble) -> dict[str, Any] | None:
    """The whole optimizer state: each entry's tensors shaped like the rank's piece of its parameter assembled like
    it (``join``: the engine's ``assemble``); the rest (a step count) from the first rank that has the entry."""
    states = [c.start.optimizer for c in caps]
    if any(s is None for s in states):
        return None
    first = states[0]
    assert first is not None
    params = layouts[0][1]
    keys = sorted({int(k) for s in states if s is not None for k in s.get("state", {})})
    out: dict[int, dict[str, Any]] = {}
    for idx in keys:
        name = params[idx] if idx < len(params) else None
        if name is None or name not in layouts[0][0]:
            raise ValueError(f"optimizer state entry {idx}: field shards.optimizer_params of {caps[0].path.name}/{MANIFEST} "
                             "names no parameter of the model for it")
        have = [(r, _entry(s, idx)) for r, s in enumerate(states) if _entry(s, idx) is not None]
        entry: dict[str, Any] = {}
        for k, v in have[0][1].items():  # type: ignore[union-attr]
            r0 = have[0][0]
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(caps[r0].model[name].shape):
                entry[k] = join([(e[k], layouts[r][0][name]) for r, e in have], f"optimizer state {k} of {name}",  # type: ignore[index]
                                [f"{caps[r].path.name}/{MANIFEST}" for r, _ in have], key=name)
            else:
                entry[k] = v
        out[idx] = entry
    return {"state": out, "param_groups": first["param_groups"]}


def _entry(state: dict[str, Any] | None, idx: int) -> dict[str, Any] | None:
    if state is None:
        return None
    st = state.get("state", {})
    got = st.get(idx, st.get(str(idx)))
    return got if isinstance(got, dict) else None


__all__ = ["check_pieces", "reassemble", "reassemble_group"]
