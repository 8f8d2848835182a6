"""The per-rank captures of one sharded step, reassembled into one process's whole state.

Under a sharding engine each rank writes its own capture folder (``cap.rank0``, ``cap.rank1`` ...), with
no collective: its ``state.pt`` / ``snapshot.pt`` hold this rank's piece of each tensor, and the
manifest's ``shards`` says where each piece sits in the whole tensor (plain JSON)::

    "sharded": "deepspeed",
    "shards": {"model": {"embed.weight": {"shape": [16, 8], "flat": 106}, ...},
               "optimizer_params": ["embed.weight", "embed.bias", ...]}

A piece is either ``{"shape": [...], "flat": k}`` (elements ``k ..`` of the flattened tensor: a ZeRO
partition's fragment, FSDP1's slice of a flat parameter) or ``{"shape": [...], "offset": [...]}`` (a block
at that offset: a DTensor's shard, or the whole tensor). The optimizer state's entry ``i`` belongs to the
parameter ``optimizer_params[i]`` and its tensors are pieces laid out as that parameter's.

``reassemble`` reads every rank's folder of the same step beside the one given, checks they belong
together, and returns one ``Captured`` with the whole model state and optimizer state, the batches of
the rank given. Reading imports no engine: a sharded capture is triaged where DeepSpeed or FSDP are not
installed.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ampdoctor.engine.replay import Captured, read_capture
from ampdoctor.errors import CaptureError

_RANK = re.compile(r"^(?P<base>.*)\.rank(?P<rank>\d+)(?P<tail>(-\d+)?)$")


def siblings(cap: Captured) -> list[Path]:
    """The folders of every rank's capture of this step, rank 0 first (``cap.rank0``, ``cap.rank1`` ...)."""
    m = cap.manifest
    world = int(m.get("world_size") or 1)
    rank = int(m.get("rank") or 0)
    hit = _RANK.match(cap.path.name)
    if hit is None or int(hit.group("rank")) != rank:
        raise CaptureError(f"{cap.path}: a {m.get('sharded')} capture of rank {rank} of {world}, but its folder is not named "
                           "<name>.rank<N>, so the other ranks' captures cannot be found beside it")
    out = []
    for r in range(world):
        p = cap.path.with_name(f"{hit.group('base')}.rank{r}{hit.group('tail')}")
        if not p.is_dir():
            raise CaptureError(f"{cap.path}: rank {r}'s capture {p.name} is not beside it; the {world} ranks' captures of "
                               f"step {m.get('step')} together hold the model (copy every {hit.group('base')}.rank* folder)")
        out.append(p)
    return out


def assemble(pieces: list[tuple[torch.Tensor, dict[str, Any]]], name: str) -> torch.Tensor:
    """The whole tensor from every rank's piece and its layout; ValueError when an element is in no piece."""
    shape = [int(x) for x in pieces[0][1]["shape"]]
    dtype = next((t.dtype for t, _ in pieces if t.numel()), pieces[0][0].dtype)
    full = torch.zeros(shape, dtype=dtype)
    have = torch.zeros(shape, dtype=torch.bool)
    for t, lay in pieces:
        if [int(x) for x in lay["shape"]] != shape:
            raise ValueError(f"{name}: the ranks' pieces disagree on its shape ({lay['shape']} and {shape})")
        if "flat" in lay:
            k = int(lay["flat"])
            if k + t.numel() > full.numel():
                raise ValueError(f"{name}: a piece of {t.numel()} elements at {k} runs past its {full.numel()}")
            full.view(-1)[k: k + t.numel()] = t.reshape(-1).to(dtype)
            have.view(-1)[k: k + t.numel()] = True
        else:
            off = [int(o) for o in lay["offset"]]
            if len(off) != t.dim():
                raise ValueError(f"{name}: a piece of {t.dim()} dimensions at an offset of {len(off)}")
            sl = tuple(slice(o, o + s) for o, s in zip(off, t.shape, strict=True))
            full[sl] = t.to(dtype)
            have[sl] = True
    if not bool(have.all()):
        raise ValueError(f"{name}: {int((~have).sum())} of {have.numel()} elements are in no rank's piece")
    return full


def _layout(cap: Captured) -> tuple[dict[str, Any], list[str]]:
    sh = cap.manifest.get("shards")
    if not isinstance(sh, dict) or not isinstance(sh.get("model"), dict):
        raise CaptureError(f"{cap.path}: this capture holds rank {cap.manifest.get('rank')}'s shard of a "
                           f"{cap.manifest.get('sharded')} model but its manifest has no field shards (where each piece "
                           "sits); it cannot be reassembled: capture again with this ampdoctor")
    model = sh["model"]
    for n, lay in model.items():
        if not (isinstance(lay, dict) and isinstance(lay.get("shape"), list)
                and (isinstance(lay.get("flat"), int) or isinstance(lay.get("offset"), list))):
            raise CaptureError(f"{cap.path}: field shards.model[{n!r}] is not {{'shape': [...], 'flat': k}} or "
                               "{'shape': [...], 'offset': [...]}; the capture is damaged (capture again)")
    params = sh.get("optimizer_params") or []
    if not isinstance(params, list) or not all(isinstance(x, str) or x is None for x in params):
        raise CaptureError(f"{cap.path}: field shards.optimizer_params is not a list of parameter names; the capture is damaged")
    return model, params


def reassemble(cap: Captured) -> tuple[Captured, str]:
    """Every rank's capture of this step, read and put together on this process: (the whole state as one
    ``Captured``, what was done, in words for the report). Raises ``CaptureError`` (one line)."""
    m = cap.manifest
    folders = siblings(cap)
    caps: list[Captured] = []
    for r, p in enumerate(folders):
        c = cap if p == cap.path else read_capture(p)
        cm = c.manifest
        if (int(cm.get("rank") or 0), cm.get("step"), cm.get("world_size"), cm.get("sharded")) != (
                r, m.get("step"), m.get("world_size"), m.get("sharded")):
            raise CaptureError(f"{p}: not rank {r}'s capture of the same {m.get('sharded')} step {m.get('step')} "
                               f"(it holds rank {cm.get('rank')}'s step {cm.get('step')} of {cm.get('world_size')})")
        if c.from_snapshot != cap.from_snapshot or c.start.step0 != cap.start.step0:
            raise CaptureError(f"{p}: rank {r}'s capture starts from step {c.start.step0}, rank {cap.manifest.get('rank')}'s "
                               f"from {cap.start.step0}; the ranks' captures do not belong together (capture again)")
        caps.append(c)
    layouts = [_layout(c) for c in caps]
    names = list(layouts[0][0])
    model: dict[str, torch.Tensor] = {}
    try:
        for n in names:
            pieces = []
            for c, (lay, _) in zip(caps, layouts, strict=True):
                if n not in c.model or n not in lay:
                    raise ValueError(f"{n}: rank {c.manifest.get('rank')}'s capture has no piece of it")
                pieces.append((c.model[n], lay[n]))
            model[n] = assemble(pieces, n)
        optimizer = _optimizer(caps, layouts)
    except ValueError as e:
        raise CaptureError(f"{cap.path}: the ranks' pieces do not make the whole model ({e}); the captures are "
                           "damaged or from different runs (capture again)") from None
    whole = replace(cap, model=model, start=replace(cap.start, optimizer=optimizer))
    words = (f"the whole model and optimizer state reassembled on one process from the {len(caps)} ranks' captures of "
             f"step {m.get('step')} ({m.get('sharded')}: {', '.join(p.name for p in folders)}); the replayed batch is "
             f"rank {m.get('rank')}'s")
    return whole, words


def _optimizer(caps: list[Captured], layouts: list[tuple[dict[str, Any], list[str]]]) -> dict[str, Any] | None:
    """The whole optimizer state: each entry's tensors assembled like its parameter; scalars (a step count) from
    rank 0."""
    first = caps[0].start.optimizer
    if first is None:
        return None
    lay0, params = layouts[0]
    state: dict[Any, dict[str, Any]] = {}
    for i, st in first["state"].items():
        idx = int(i)
        name = params[idx] if idx < len(params) else None
        if name is None or name not in lay0:
            raise ValueError(f"optimizer state entry {idx} names no parameter of the capture")
        out: dict[str, Any] = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1:  # a piece (a step count is a 0-d tensor or a number)
                pieces = []
                for c, (lay, _) in zip(caps, layouts, strict=True):
                    opt = c.start.optimizer
                    part = opt["state"].get(i, opt["state"].get(idx)) if opt is not None else None
                    if part is None or k not in part:
                        raise ValueError(f"{name}: rank {c.manifest.get('rank')}'s optimizer state has no {k!r}")
                    pieces.append((part[k], lay[name]))
                out[k] = assemble(pieces, f"{name} ({k})")
            else:
                out[k] = v
        state[idx] = out
    return {"state": state, "param_groups": first["param_groups"]}


__all__ = ["assemble", "reassemble", "siblings"]
