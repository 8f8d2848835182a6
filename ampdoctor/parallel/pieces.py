"""A sharded model's statistics, reduced across its ranks inside the step's one exchange; and a capture's pieces
put back together on one process. What an engine decides (which piece counts, where a piece sits) is its
``Reader``'s (``parallel.protocol``); what is reduced, and how, is here, the same for every engine.

Under FSDP2 (``fully_shard``), tensor parallelism (DTensor parameters) and FSDP1
(``FullyShardedDataParallel(use_orig_params=True)``) a rank holds a piece of each parameter and of its
gradient: a DTensor's local shard (``to_local()``, no collective), or FSDP1's slice of the flattened
parameter (which may be empty). Everything the monitor measures of parameters is measured on the pieces
and then reduced across the ranks, in the collective the ranks' exchange runs anyway
(``parallel.exchange.RankExchange.exchange``):

- **norms**: each parameter's sum of squares (``P`` float64, SUM): the global norm is the square root of
  the total, exactly what ``clip_grad_norm_`` computes; a sentinel and the first non-finite parameter read
  the global per-parameter norms;
- **rows** (a recorded step's statistics of parameter gradients and weights): the counts (SUM) ride in
  the same collective, absmax and the smallest non-zero in a second one (MAX), recorded steps only.

A piece that is a replica (a ``Replicate`` placement, a plain parameter of a tensor-parallel model, FSDP1's
``NO_SHARD``) counts on one rank only, so replicated parameters count once. Rows are aligned by parameter
name (every rank has every name; a rank may hold an empty slice, or, under FSDP1, no gradient at all).

``layout`` says where each piece of the model's state sits in the whole tensor (plain JSON), so a capture
of every rank's pieces is reassembled on one process (``capture.reassemble``, with ``assemble``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ampdoctor.records import NCOLS, Col, StepStats
from ampdoctor.watch.model_view import named_parameters, unwrap, user_name

NSUM = Col.NAN + 2
"""Columns of a row reduced by SUM: the counts (``Col.NUMEL`` .. ``Col.NAN``) and one for 'a rank holds it'."""


def is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


class Shards:
    """The pieces this rank holds of a sharded model's parameters, and their reduction across ranks.

    ``params``: the optimizer's parameters (the norms' order); ``names``: id → the user's name."""

    def __init__(self, engine: str, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> None:
        from ampdoctor.parallel.registry import named

        self.engine = engine
        self.rank = rank
        self.world = world
        inner = unwrap(model)
        eng = named(engine)
        if eng is None:
            raise ValueError(f"no parallel engine is named {engine!r}")
        self.reader = eng.read(inner, params, rank, world)
        """This rank's pieces as the engine reads them (``parallel.protocol.Reader``)."""
        self.problem: str | None = self.reader.problem
        """Why this layout cannot be reduced correctly (the monitor then turns off), else None."""
        self.named = named_parameters(inner)
        """(user name, parameter) of the model: the rows' order."""
        self.index = {n: i for i, (n, _) in enumerate(self.named)}
        self.counts = [self.reader.counts(p) for p in params]
        """Per optimizer parameter: whether this rank's piece counts in the sums (False: a replica)."""
        self.row_counts = [self.reader.counts(p) for _, p in self.named]
        self._w: dict[torch.device, torch.Tensor] = {}

    # norms ------------------------------------------------------------------------------------------
    def weights(self, device: torch.device) -> torch.Tensor:
        w = self._w.get(device)
        if w is None:
            w = self._w[device] = torch.tensor([1.0 if c else 0.0 for c in self.counts], dtype=torch.float64, device=device)
        return w

    def sums(self, per: torch.Tensor | None, present: Sequence[int], device: torch.device) -> torch.Tensor:
        """The ``P`` sums of squares this rank adds (0 for a parameter without a gradient here, or a replica
        another rank counts), on the device: ``per`` holds the local norms of the ``present`` parameters."""
        out = torch.zeros(len(self.counts), dtype=torch.float64, device=device)
        if per is not None and len(present):
            out[torch.tensor(list(present), device=device)] = per.to(device, torch.float64).square()
        return out * self.weights(device)

    # rows -------------------------------------------------------------------------------------------
    def sizes(self, recorded: bool) -> tuple[int, int]:
        """(numbers added to the SUM collective, numbers in the MAX one) at a step (recorded or not)."""
        n = len(self.named)
        return len(self.counts) + (2 * n * NSUM if recorded else 0), (2 * n * 2 if recorded else 0)

    def tables(self, keys: list[Hashable], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A recorded step's rows of parameter gradients and weights, aligned by name: (SUM part, MAX part),
        flat, on the rows' device."""
        n = len(self.named)
        dev = rows.device
        at, sel = [], []
        for i, k in enumerate(keys):
            if isinstance(k, tuple) and k[0] in ("pgrad", "param"):
                j = self.index.get(str(k[1]))
                if j is not None:
                    at.append(j + (n if k[0] == "param" else 0))
                    sel.append(i)
        sums = torch.zeros((2 * n, NSUM), dtype=torch.float64, device=dev)
        maxes = torch.zeros((2 * n, 2), dtype=torch.float64, device=dev)
        maxes[:, 1] = -float("inf")
        if at:
            r = rows[torch.tensor(sel, device=dev)].to(torch.float64)
            w = torch.tensor([1.0 if self.row_counts[j % n] else 0.0 for j in at], dtype=torch.float64, device=dev)
            idx = torch.tensor(at, device=dev)
            part = torch.cat([r[:, : Col.NAN + 1] * w[:, None], torch.ones((len(at), 1), dtype=torch.float64, device=dev)], 1)
            sums[idx] = part
            maxes[idx] = torch.stack([r[:, Col.ABSMAX], -r[:, Col.MIN_NONZERO]], 1)
        return sums.reshape(-1), maxes.reshape(-1)

    def apply(self, st: StepStats, sums: np.ndarray, maxes: np.ndarray) -> None:
        """Replace the step's parameter rows by the reduced ones (every rank gets every name's whole row)."""
        n = len(self.named)
        s = np.asarray(sums, dtype=np.float64).reshape(2 * n, NSUM)
        m = np.asarray(maxes, dtype=np.float64).reshape(2 * n, 2)
        for j in range(2 * n):
            if s[j, NSUM - 1] <= 0:  # no rank held a row for it (no gradient anywhere, or weights not recorded)
                continue
            row = np.zeros(NCOLS, dtype=np.float64)
            row[: Col.NAN + 1] = s[j, : Col.NAN + 1]
            row[Col.ABSMAX] = m[j, 0]
            row[Col.MIN_NONZERO] = -m[j, 1]
            name = self.named[j % n][0]
            (st.param if j >= n else st.pgrad)[name] = row

    def failed_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """What a rank whose own rows failed adds to the SUM and the MAX (the sizes every rank uses): every row
        marked held by nobody (``-inf`` in its 'held here' column), so every rank drops the step's reduced rows
        rather than take wrong ones."""
        n = len(self.named)
        sums = torch.zeros((2 * n, NSUM), dtype=torch.float64, device=device)
        sums[:, NSUM - 1] = -float("inf")
        maxes = torch.zeros((2 * n, 2), dtype=torch.float64, device=device)
        maxes[:, 1] = -float("inf")
        return sums.reshape(-1), maxes.reshape(-1)

    # the capture ------------------------------------------------------------------------------------
    def layout(self, model: nn.Module) -> dict[str, Any]:
        """Where each tensor of ``capture.local_state(model)`` sits in the whole one (plain JSON):
        ``{"shape": [...], "offset": [...]}`` (a block: a DTensor's shard, or the whole tensor) or
        ``{"shape": [...], "flat": k}`` (FSDP1: elements ``k..`` of the flattened tensor)."""
        inner = unwrap(model)
        out: dict[str, Any] = {}
        for n, p in [*inner.named_parameters(), *inner.named_buffers()]:
            out[user_name(n)] = self._piece(p)
        return out

    def _piece(self, t: torch.Tensor) -> dict[str, Any]:
        return self.reader.piece(t)


def trip_stats(hooks: Any, step: int, inv_scale: float | None, shards: Shards | None, ranks: Any) -> StepStats:
    """The sentinel tripped on a step not recorded: the parameter gradients (and weights with ``weights=True``)
    taken in full now, on this step only (``hooks``: the monitor's ``watch.hooks.Hooks``; ``inv_scale``: the
    gradients still carry the loss scale). Under a sharding engine with the ranks' exchange (``ranks``), every
    rank trips at the same step and the pieces' rows are reduced across the ranks by name, in one SUM and one
    MAX that every rank joins exactly once: a rank whose own part fails before them joins them all the same with
    its rows marked held by nobody (``Shards.failed_tables``: every rank then drops that step's rows), and
    raises after them (its monitor turns off and joins the next exchange flagged off)."""
    if shards is None or ranks is None:
        hooks.begin_step(step, record=True)
        hooks.after_backward(inv_scale)
        hooks.after_step()
        st = hooks.end_step()
        st.extra["sentinel_trip"] = 1.0
        return st
    import torch.distributed as dist

    ns, nm = shards.sizes(True)
    nrow = len(shards.counts)
    joined = [False]

    def join(sums: torch.Tensor, maxes: torch.Tensor) -> torch.Tensor:
        joined[0] = True
        dist.all_reduce(sums, group=ranks.group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=ranks.group)
        return torch.cat([sums, maxes])

    def reduce(keys: list[Hashable], rows: torch.Tensor) -> torch.Tensor:
        try:
            sums, maxes = shards.tables(keys, rows)
        except Exception:
            sums, maxes = shards.failed_tables(rows.device)
        return join(sums, maxes)

    try:
        hooks.begin_step(step, record=True)
        hooks.after_backward(inv_scale)
        hooks.after_step()
        st = hooks.end_step(reduce)
    except Exception:
        if not joined[0]:
            dev = next((p.device for _, p in shards.named), torch.device("cpu"))
            join(*shards.failed_tables(dev))
        raise
    got = hooks.exchanged
    if got is not None:
        shards.apply(st, got[: ns - nrow], got[ns - nrow: ns - nrow + nm])
    st.extra["sentinel_trip"] = 1.0
    return st


def dtensor_piece(t: torch.Tensor) -> dict[str, Any]:
    """Where this rank's piece of ``t`` sits in the whole tensor: a DTensor's shard at its global offset, or a
    plain tensor whole (``{"shape": [...], "offset": [...]}``)."""
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
        return {"shape": [int(x) for x in t.shape], "offset": [int(x) for x in offset]}
    return {"shape": [int(x) for x in t.shape], "offset": [0] * t.dim()}


def dtype_name(dt: Any) -> str | None:
    return str(dt).removeprefix("torch.") if isinstance(dt, torch.dtype) else None


class BlockReader:
    """A rank's pieces that are blocks of the whole tensors (``parallel.protocol.Reader``): a DTensor's local
    shard at its global offset, or a plain tensor whole (a replica: it counts on rank 0 only, unless
    ``plain_shards``). A DTensor's piece counts where its mesh coordinate is 0 along every dimension it is not
    sharded on; a mesh that is not 1-D, or not the whole world, is a ``problem``."""

    def __init__(self, tensors: Sequence[torch.Tensor], rank: int, world: int, plain_shards: bool = False) -> None:
        self.rank = rank
        self.world = world
        self.plain_shards = plain_shards
        self.problem: str | None = None
        self.groups: list[int] | None = None  # a 1-D layout: the engine's shares_batch decides
        for t in tensors:
            self.problem = self.problem or self.mesh_problem(t)

    def mesh_problem(self, p: torch.Tensor) -> str | None:
        """Why ``p``'s mesh cannot be reduced over the world (a fragment), or None."""
        if not is_dtensor(p):
            return None
        mesh = p.device_mesh  # type: ignore[attr-defined]
        if mesh.ndim != 1:
            return (f"a {mesh.ndim}-D device mesh {tuple(int(x) for x in mesh.shape)} (HSDP, data parallel x "
                    "tensor parallel: the exchange would judge a replica's batch as the whole run's)")
        if mesh.size() != self.world:
            return (f"a DTensor mesh of {mesh.size()} rank(s) in a world of {self.world} (the replicas "
                    "outside the mesh would count twice)")
        return None

    def counts(self, p: torch.Tensor) -> bool:
        if is_dtensor(p):
            coord = p.device_mesh.get_coordinate() or []  # type: ignore[attr-defined]
            return all(c == 0 for c, pl in zip(coord, p.placements, strict=False)  # type: ignore[attr-defined]
                       if not pl.is_shard())
        return self.plain_shards or self.rank == 0

    def piece(self, t: torch.Tensor) -> dict[str, Any]:
        return dtensor_piece(t)


def dtensor_holds(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor."""
    return any(is_dtensor(p) for p in model.parameters())


def world_mesh(rec: dict[str, Any]) -> Any:
    """The 1-D DeviceMesh of the recorded shape on the CPU (every rank calls it: its process group is a collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(int(x) for x in rec["mesh"]))


def module_kinds(model: nn.Module) -> set[str]:
    """The class names of ``model``'s modules (how an engine knows its wrappers without importing them)."""
    return {type(m).__name__ for m in model.modules()}


def claimed_shape(pieces: list[tuple[torch.Tensor, dict[str, Any]]], name: str, where: list[str], key: str) -> list[int]:
    """The whole shape every piece names, checked against the pieces before anything is allocated: every piece names
    the same shape, sits inside it, and together they hold at least its elements (ValueError naming the tensor, the
    rank's file and the field; ``where[i]``: piece ``i``'s manifest)."""
    at = [where[i] if i < len(where) else f"rank {i}'s capture" for i in range(len(pieces))]
    field = f"shards.model[{key!r}]"
    shape = [int(x) for x in pieces[0][1]["shape"]]
    whole = math.prod(shape)  # Python integers: a claimed shape of 10**30 elements does not wrap
    for i, (t, lay) in enumerate(pieces):
        if [int(x) for x in lay["shape"]] != shape:
            raise ValueError(f"{name}: {at[i]} field {field}.shape is {lay['shape']} and {at[0]}'s is {shape}; the "
                             "ranks' pieces disagree on its shape")
        if "flat" in lay:
            k = int(lay["flat"])
            if k + t.numel() > whole:
                raise ValueError(f"{name}: {at[i]} field {field}.flat is {k}: its piece of {t.numel()} elements runs past "
                                 f"the {whole} of its shape {shape}")
            continue
        off = [int(o) for o in lay["offset"]]
        if len(off) != t.dim() or len(off) != len(shape):
            raise ValueError(f"{name}: {at[i]} field {field}.offset is {off} ({len(off)} dimensions) for a piece of shape "
                             f"{list(t.shape)} in a tensor of shape {shape}")
        past = [d for d, (o, n, full) in enumerate(zip(off, t.shape, shape, strict=True)) if o + n > full]
        if past:
            d = past[0]
            raise ValueError(f"{name}: {at[i]} field {field}.offset is {off}, and its piece of shape {list(t.shape)} "
                             f"runs past the shape {shape} in dimension {d} ({off[d]} + {t.shape[d]} > {shape[d]})")
    held = sum(t.numel() for t, _ in pieces)
    if whole > held:
        raise ValueError(f"{name}: field {field}.shape {shape} claims {whole} elements and the ranks' pieces hold {held} "
                         f"({', '.join(at)}): {whole - held} of {whole} elements are in no rank's piece")
    return shape


def _fits(shape: list[int], dtype: torch.dtype, name: str) -> None:
    """The whole tensor (and its coverage mask) within the memory this process may still take (ValueError)."""
    from ampdoctor.input.limits import free_memory, human_bytes

    need = math.prod(shape) * (dtype.itemsize + 1)
    free = free_memory()
    if free is not None and need > free:
        raise ValueError(f"{name}: its shape {shape} takes {human_bytes(need)} to reassemble, more than the "
                         f"{human_bytes(free)} this machine has free")


def assemble(pieces: list[tuple[torch.Tensor, dict[str, Any]]], name: str, where: list[str] | None = None,
             key: str | None = None) -> torch.Tensor:
    """The whole tensor from every rank's piece and its layout (``capture.reassemble`` describes the format);
    ValueError (naming the tensor, the rank's manifest in ``where`` and the field) when the pieces disagree on its
    shape, one runs past it, they hold fewer elements than it claims, it does not fit in free memory, or an element is
    in no piece. Nothing is allocated before those checks: at most what the pieces hold. ``key``: the layout's
    entry (default ``name``)."""
    key = name if key is None else key  # the layout's entry (an optimizer state tensor is laid out as its parameter)
    shape = claimed_shape(pieces, name, where or [], key)
    dtype = next((t.dtype for t, _ in pieces if t.numel()), pieces[0][0].dtype)
    _fits(shape, dtype, name)
    full = torch.zeros(shape, dtype=dtype)
    have = torch.zeros(shape, dtype=torch.bool)
    for t, lay in pieces:
        if "flat" in lay:
            k = int(lay["flat"])
            full.view(-1)[k: k + t.numel()] = t.reshape(-1).to(dtype)
            have.view(-1)[k: k + t.numel()] = True
            continue
        off = [int(o) for o in lay["offset"]]
        if list(t.shape) == shape and not any(off) and bool(have.all()):
            continue  # a replica of what is already there
        sl = tuple(slice(o, o + s) for o, s in zip(off, t.shape, strict=True))
        full[sl] = t.to(dtype)
        have[sl] = True
    if not bool(have.all()):
        raise ValueError(f"{name}: {int((~have).sum())} of {have.numel()} elements are in no rank's piece "
                         f"(field shards.model[{key!r}] of {', '.join(where or []) or 'the ranks'})")
    return full


__all__ = ["NSUM", "BlockReader", "Shards", "assemble", "claimed_shape", "dtensor_holds", "dtensor_piece", "dtype_name", "is_dtensor",
           "module_kinds",
           "trip_stats", "world_mesh"]
