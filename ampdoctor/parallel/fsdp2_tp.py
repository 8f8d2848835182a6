"""FSDP2 x tensor parallelism on a 2-D device mesh (``dp``, ``tp``): ``parallelize_module`` over the ``tp`` dimension,
then ``fully_shard`` over ``dp``. One engine of ``parallel.protocol.Engine``.

How the pieces sit (read off the model, no collective):

- a parameter the tensor-parallel plan placed is a DTensor on the 2-D mesh: ``Shard`` or ``Replicate`` on ``tp``,
  and FSDP's ``Shard(0)`` on ``dp`` (``_StridedShard`` when ``tp`` shards the same dimension: each rank's piece is
  still one block, at the offset ``compute_local_shape_and_global_offset`` gives);
- a parameter no style placed (a LayerNorm, a head left whole) is a DTensor on the ``dp`` sub-mesh only: the
  ``tp`` ranks of one ``dp`` coordinate hold the same piece.

**counts**: a piece counts in the exchange's SUM on exactly one rank of the ranks that hold a copy of it: its
coordinate is 0 on every dimension of the whole mesh where the tensor is not sharded (a ``Replicate`` placement,
or a dimension of the root mesh its sub-mesh leaves out). The norms are then the global ones: each element of the
whole gradient is counted once.

**which rank went first**: the ``tp`` ranks of one ``dp`` coordinate run one batch and their forward collectives
carry one rank's NaN into the others; the ``dp`` groups run different batches. ``batch_groups`` gives each rank its
``dp`` coordinate: the exchange names the lowest group that saw it locally, and in it the rank whose forward went
bad earliest (``parallel.exchange``'s ``RankView.groups``).

**record**: ``recipe`` holds the mesh's shape and dimension names, the ``tp`` plan (``parallel.tp``'s styles and
each parameter's ``tp`` placement), and FSDP2's ``fully_shard`` modules and ``MixedPrecisionPolicy``.
**rebuild** on N ranks lays a fresh model out the same way: the plan on ``mesh[tp]``, then ``fully_shard`` of the
recorded modules on ``mesh[dp]``; the replay then checks every piece against the capture's layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import CaptureError
from ampdoctor.parallel.fsdp2 import recipe as fsdp2_recipe
from ampdoctor.parallel.pieces import assemble, dtensor_piece, is_dtensor
from ampdoctor.parallel.protocol import Engine
from ampdoctor.parallel.tp import STYLES, placement_code
from ampdoctor.parallel.tp import rebuild as tp_rebuild
from ampdoctor.parallel.tp import recipe as tp_recipe
from ampdoctor.parallel.tp import refusal as tp_refusal
from ampdoctor.watch.model_view import unwrap, user_name

NAME = "fsdp2_tp"


def fsdp_meshes(model: nn.Module) -> list[Any]:
    """The device mesh of every FSDP2 parameter group of ``model`` (``fully_shard``'s ``mesh_info.mesh``)."""
    out = []
    for m in unwrap(model).modules():
        get = getattr(m, "_get_fsdp_state", None)
        group = getattr(get(), "_fsdp_param_group", None) if get is not None else None
        info = getattr(group, "mesh_info", None)
        if info is not None:
            out.append(info.mesh)
    return out


def root_mesh(mesh: Any) -> Any:
    """The whole mesh a sub-mesh was sliced from (itself when it is whole)."""
    get = getattr(mesh, "_get_root_mesh", None)
    root = get() if get is not None else None
    return root if root is not None else mesh


def param_meshes(model: nn.Module) -> list[Any]:
    """The root device mesh of each DTensor parameter of ``model``."""
    return [root_mesh(p.device_mesh) for p in unwrap(model).parameters() if is_dtensor(p)]  # type: ignore[attr-defined]


def is_shard(pl: Any) -> bool:
    """A placement that splits the tensor: ``Shard``, or FSDP's ``_StridedShard`` over a ``tp`` shard of the same
    dimension (which ``is_shard()`` does not count as one in every torch)."""
    return bool(pl.is_shard()) or type(pl).__name__ == "_StridedShard"


def counts_once(p: torch.Tensor) -> bool:
    """Whether this rank's piece of the DTensor ``p`` is the one of its copies that counts (module doc): its coordinate
    is 0 on every root-mesh dimension where ``p`` is not sharded (a ``Replicate`` placement, or a dimension its
    sub-mesh leaves out)."""
    mesh = p.device_mesh  # type: ignore[attr-defined]
    root = root_mesh(mesh)
    names = list(root.mesh_dim_names or [])
    own = list(mesh.mesh_dim_names or []) if root is not mesh else names
    sharded = {own[i] if i < len(own) else i for i, pl in enumerate(p.placements) if is_shard(pl)}  # type: ignore[attr-defined]
    return counted_at(list(root.get_coordinate() or []), names, sharded)


def counted_at(coord: list[int], names: list[str], sharded: set[Any]) -> bool:
    """The rule of ``counts_once`` on a rank's root-mesh coordinate: 0 on every dimension (by name, else by index)
    not in ``sharded``."""
    return all(c == 0 for d, c in enumerate(coord) if (names[d] if d < len(names) else d) not in sharded)


def groups_by(mesh: Any, dims: list[int]) -> list[int]:
    """Per rank of the world (``mesh`` is the whole one), the number of the group of ranks that share one batch: the
    ranks whose coordinates on ``dims`` (the data-parallel dimensions) are equal."""
    ids = mesh.mesh.reshape(*mesh.mesh.shape)
    out = [0] * int(ids.numel())
    for coord in torch.cartesian_prod(*[torch.arange(int(n)) for n in ids.shape]).reshape(-1, ids.dim()).tolist():
        key = 0
        for d in dims:
            key = key * int(ids.shape[d]) + int(coord[d])
        out[int(ids[tuple(coord)])] = key
    return out


class MeshReader:
    """One rank's pieces of a model on a 2-D mesh (``parallel.protocol.Reader``): shards count, and of a replica's
    copies the one at coordinate 0 (``counts_once``); ``groups``: per rank, its batch group (None: each its own)."""

    def __init__(self, model: nn.Module, rank: int, world: int, groups: list[int] | None, named: bool = True) -> None:
        self.rank = rank
        self.groups = groups
        self.problem = mesh_problem(model, world, named)

    def counts(self, p: torch.Tensor) -> bool:
        return counts_once(p) if is_dtensor(p) else self.rank == 0

    def piece(self, t: torch.Tensor) -> dict[str, Any]:
        return dtensor_piece(t)


def mesh_problem(model: nn.Module, world: int, named: bool = True, ndim: int = 2) -> str | None:
    """Why the model's 2-D mesh cannot be reduced over ``world`` ranks (a fragment), or None (``named``: its
    dimensions must have names, to tell ``dp`` from ``tp``)."""
    roots = {id(m): m for m in param_meshes(model)}
    if len(roots) != 1:
        return f"parameters on {len(roots)} different device meshes"
    root = next(iter(roots.values()))
    shape = tuple(int(x) for x in root.shape)
    if root.ndim != ndim:
        return f"a {root.ndim}-D device mesh {shape} (2-D meshes are read: FSDP2 x tensor parallelism, HSDP)"
    if int(root.size()) != world:
        return f"a {shape} device mesh of {root.size()} rank(s) in a world of {world}"
    if named and not root.mesh_dim_names:
        return f"a {shape} device mesh without dimension names"
    return None


def device_mesh(rec: dict[str, Any]) -> Any:
    """The recorded mesh (shape and dimension names) on the CPU: every rank of a replay builds it, first."""
    from torch.distributed.device_mesh import init_device_mesh

    names = rec.get("mesh_dim_names")
    return init_device_mesh("cpu", tuple(int(x) for x in rec["mesh"]), mesh_dim_names=tuple(names) if names else None)


class Fsdp2Tp:
    """FSDP2 over ``dp`` x tensor parallelism over ``tp`` (module doc)."""

    name = NAME
    label = "FSDP2 x tensor parallelism (a 2-D device mesh)"
    sharded = True
    monitored = True
    priority = 26
    shares_batch = True
    casts_inputs = True
    replay_requires = "torch.distributed.tensor.parallel"

    # read -------------------------------------------------------------------------------------------
    def holds(self, model: nn.Module) -> bool:
        """FSDP2's groups on a 1-D mesh, and parameters on a 2-D one (the ``tp`` plan's)."""
        fsdp = fsdp_meshes(model)
        return bool(fsdp) and all(m.ndim == 1 for m in fsdp) and any(m.ndim == 2 for m in param_meshes(model))

    def read(self, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> MeshReader:
        return MeshReader(model, rank, world, self.batch_groups(model))

    def batch_groups(self, model: nn.Module) -> list[int] | None:
        """Per rank, its ``dp`` coordinate: the ranks of one group run one batch (module doc)."""
        fsdp = fsdp_meshes(model)
        roots = param_meshes(model)
        if not fsdp or not roots or not fsdp[0].mesh_dim_names or not roots[0].mesh_dim_names:
            return None
        names = list(roots[0].mesh_dim_names)
        return groups_by(roots[0], [names.index(n) for n in fsdp[0].mesh_dim_names if n in names])

    # record -----------------------------------------------------------------------------------------
    def recipe(self, model: nn.Module) -> dict[str, Any] | None:
        """``{"engine": "fsdp2_tp", "mesh": [dp, tp], "mesh_dim_names": [...], "dp": name, "tp": name,
        "fully_shard": [...], "mp_policy": {...}, "plan": {...}, "placements": {name: [tp placement]},
        "unsupported": [...]}``."""
        fs = fsdp2_recipe(model)
        tp = tp_recipe(model)
        fsdp = fsdp_meshes(model)
        roots = param_meshes(model)
        if fs is None or tp is None or not fsdp or not roots or not roots[0].mesh_dim_names:
            return None
        names = [str(n) for n in roots[0].mesh_dim_names]
        dp = str(fsdp[0].mesh_dim_names[0]) if fsdp[0].mesh_dim_names else names[0]
        tpn = next(n for n in names if n != dp)
        at = names.index(tpn)
        placements: dict[str, list[str]] = {}
        for n, p in unwrap(model).named_parameters():
            if is_dtensor(p) and p.device_mesh.ndim == 2:  # type: ignore[attr-defined]
                placements[user_name(n)] = [placement_code(p.placements[at])]  # type: ignore[attr-defined]
        return {"engine": NAME, "mesh": [int(x) for x in roots[0].shape], "mesh_dim_names": names, "dp": dp, "tp": tpn,
                "fully_shard": fs["fully_shard"], "mp_policy": fs["mp_policy"], "plan": tp["plan"],
                "placements": placements, "unsupported": tp["unsupported"]}

    # reassemble -------------------------------------------------------------------------------------
    def assemble(self, pieces: list[Any], name: str, where: list[str] | None = None, key: str | None = None,
                 ) -> torch.Tensor:
        return assemble(pieces, name, where, key)

    # rebuild ----------------------------------------------------------------------------------------
    def device_mesh(self, rec: dict[str, Any]) -> Any:
        return device_mesh(rec)

    def refusal(self, rec: dict[str, Any]) -> str | None:
        names = rec.get("mesh_dim_names") or []
        if len(rec.get("mesh") or []) != 2 or len(names) != 2 or rec.get("dp") not in names or rec.get("tp") not in names:
            return (f"its mesh {rec.get('mesh')} with dimensions {names} is not a 2-D (dp, tp) mesh (a replay rebuilds "
                    "FSDP2 over one dimension and tensor parallelism over the other)")
        if not rec.get("fully_shard"):
            return "it records no fully_shard module"
        return tp_refusal({**rec, "mesh": [rec["mesh"][names.index(rec["tp"])]]})

    def rebuild(self, model: nn.Module, rec: dict[str, Any], mesh: Any, low: bool) -> nn.Module:
        """The plan on ``mesh[tp]``, then ``fully_shard`` of the recorded modules on ``mesh[dp]`` (``low``: with the
        run's ``MixedPrecisionPolicy``)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if list(mesh.mesh_dim_names or []) != list(rec["mesh_dim_names"]):
            raise CaptureError(f"the replay's mesh has dimensions {mesh.mesh_dim_names}; the run's had {rec['mesh_dim_names']}")
        tp_rebuild(model, rec, mesh[rec["tp"]])
        mp = {k: getattr(torch, v) if isinstance(v, str) else v for k, v in (rec.get("mp_policy") or {}).items()}
        policy = MixedPrecisionPolicy(**mp) if low and mp else MixedPrecisionPolicy()
        mods = dict(model.named_modules())
        for name in rec["fully_shard"]:
            if name not in mods:
                raise CaptureError(f"the run applied fully_shard to {name!r}, which the spec's model has no module of")
            fully_shard(mods[name], mesh=mesh[rec["dp"]], mp_policy=policy)
        return model

    def grad_scaler(self) -> type[torch.amp.GradScaler]:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler


ENGINE: Engine = Fsdp2Tp()
"""The engine (``parallel.registry`` finds it)."""

__all__ = ["ENGINE", "NAME", "STYLES", "Fsdp2Tp", "MeshReader", "counted_at", "counts_once", "device_mesh", "is_shard", "mesh_problem", "fsdp_meshes", "groups_by", "param_meshes", "root_mesh"]
