"""Tensor parallelism (DTensor parameters from ``parallelize_module``, no FSDP) as a parallel engine
(``parallel.protocol.Engine``): a rank's pieces are its DTensors' local shards (``parallel.pieces.BlockReader``),
and the ranks run one batch (the exchange names the rank whose forward went bad first). Its layout is recorded at
capture time (plain JSON, the manifest's ``shards.recipe``) and rebuilt on the spec's model for a replay on N ranks
(``engine.shard_replay``).

What is recorded, read off the model with no collective:

- ``mesh``: the shape of the device mesh the parameters live on (a replay rebuilds a 1-D mesh only);
- ``plan``: per module the ``parallelize_module`` style applied to it (``ColwiseParallel`` or
  ``RowwiseParallel``) with its ``input_layouts``, ``output_layouts`` and ``use_local_output``, read from the
  forward hooks the style registered (their ``partial``'s arguments). Another style (``SequenceParallel``,
  ``PrepareModuleInput``, ...) or two styles on one module is recorded by name in ``unsupported``, and a
  replay under it is refused;
- ``placements``: per parameter its DTensor placements (``"S(d)"`` ``Shard(d)``, ``"R"`` ``Replicate()``,
  ``"P"`` ``Partial()``), under the user's names; a parameter that no recorded style owns is rebuilt with
  ``distribute_tensor`` on these placements.

Placements and styles are written as strings, so the manifest stays JSON and a capture loads with
``weights_only=True``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import CaptureError
from ampdoctor.parallel.pieces import BlockReader, assemble, dtensor_holds, is_dtensor, world_mesh
from ampdoctor.parallel.protocol import Engine
from ampdoctor.watch.model_view import named_parameters, unwrap, user_name

STYLES = ("ColwiseParallel", "RowwiseParallel")
"""The parallelize styles a replay rebuilds."""


def placement_code(p: Any) -> str:
    """``"S(d)"``, ``"R"``, ``"P"`` (or the placement's class name) of one DTensor placement."""
    kind = type(p).__name__
    if kind == "Shard" or kind == "_StridedShard":
        return f"S({int(p.dim)})"
    return {"Replicate": "R", "Partial": "P"}.get(kind, kind)


def placement(code: str) -> Any:
    """The DTensor placement of a code ``placement_code`` wrote; CaptureError for another."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code == "R":
        return Replicate()
    if code == "P":
        return Partial()
    if code.startswith("S(") and code.endswith(")"):
        return Shard(int(code[2:-1]))
    raise CaptureError(f"the capture records a placement {code!r} this replay cannot rebuild")


def _codes(layouts: Any) -> list[str] | None:
    if layouts is None:
        return None
    return [placement_code(p) for p in (layouts if isinstance(layouts, (tuple, list)) else (layouts,))]


def _styles(mod: nn.Module) -> dict[str, dict[str, Any]]:
    """The parallelize styles whose forward hooks sit on ``mod``: class name -> their recorded arguments."""
    found: dict[str, dict[str, Any]] = {}
    for kind, hooks in (("in", mod._forward_pre_hooks), ("out", mod._forward_hooks)):
        for h in hooks.values():
            for cell in getattr(h, "__closure__", None) or ():
                try:
                    fn = cell.cell_contents
                except ValueError:
                    continue
                if not isinstance(fn, functools.partial) or "tensor.parallel" not in getattr(fn.func, "__module__", ""):
                    continue
                cls, _, meth = getattr(fn.func, "__qualname__", "").rpartition(".")
                rec = found.setdefault(cls, {})
                if cls in STYLES and kind == "in" and meth == "_prepare_input_fn" and len(fn.args) >= 1:
                    rec["input_layouts"] = _codes(fn.args[0])
                elif cls in STYLES and kind == "out" and meth == "_prepare_output_fn" and len(fn.args) >= 2:
                    rec["output_layouts"] = _codes(fn.args[0])
                    rec["use_local_output"] = bool(fn.args[1])
    return found


def recipe(model: nn.Module) -> dict[str, Any] | None:
    """The tensor-parallel layout of ``model`` (see the module), or None when no parameter is a DTensor."""
    inner = unwrap(model)
    placements: dict[str, list[str]] = {}
    mesh: list[int] | None = None
    for n, p in inner.named_parameters():
        if is_dtensor(p):
            placements[user_name(n)] = [placement_code(x) for x in p.placements]  # type: ignore[attr-defined]
            mesh = mesh or [int(x) for x in p.device_mesh.shape]  # type: ignore[attr-defined]
    if mesh is None:
        return None
    plan: dict[str, dict[str, Any]] = {}
    unsupported: list[str] = []
    for name, mod in inner.named_modules():
        found = _styles(mod)
        if len(found) == 1 and next(iter(found)) in STYLES and len(next(iter(found.values()))) == 3:
            (style, args), = found.items()
            plan[user_name(name)] = {"style": style, **args}
        elif found:
            unsupported.append(f"{'+'.join(sorted(found))} on {user_name(name) or 'the model'}")
    return {"engine": "tensor_parallel", "mesh": mesh, "plan": plan, "placements": placements,
            "unsupported": unsupported}


def refusal(rec: dict[str, Any]) -> str | None:
    """Why a replay cannot rebuild this recorded layout (a fragment of one line), or None when it can."""
    if rec.get("unsupported"):
        return f"its tensor-parallel plan uses {', '.join(rec['unsupported'])} (a replay rebuilds {' and '.join(STYLES)} only)"
    if len(rec.get("mesh") or []) != 1:
        return f"its tensor-parallel mesh has shape {rec.get('mesh')} (a replay rebuilds a 1-D mesh only)"
    bad = [c for pl in (rec.get("placements") or {}).values() for c in pl if c != "R" and not c.startswith("S(")]
    if bad:
        return f"a parameter is placed {bad[0]} (a replay rebuilds Shard and Replicate placements only)"
    return None


def rebuild(model: nn.Module, rec: dict[str, Any], mesh: Any, low: bool = True) -> nn.Module:
    """Apply the recorded plan to the spec's ``model`` on ``mesh`` (``parallelize_module`` with each module's
    style, then ``distribute_tensor`` for a recorded parameter no style placed); CaptureError when the model
    lacks a recorded module or parameter, or a parameter ends up placed otherwise than recorded. ``low``: unused
    (the plan is the same in every precision). Returns ``model``, laid out in place."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    classes = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel}
    mods = dict(model.named_modules())
    for name, st in (rec.get("plan") or {}).items():
        if name not in mods:
            raise CaptureError(f"the run parallelized {name!r} ({st['style']}), which the spec's model has no module of")
        layouts = {k: tuple(placement(c) for c in st[k]) for k in ("input_layouts", "output_layouts") if st.get(k)}
        style = classes[st["style"]](**{k: v[0] if len(v) == 1 else v for k, v in layouts.items()},  # type: ignore[arg-type]
                                     use_local_output=bool(st.get("use_local_output", True)))
        parallelize_module(mods[name], mesh, style)
    params = dict(model.named_parameters())
    for name, codes in (rec.get("placements") or {}).items():
        p = params.get(name)
        if p is None:
            raise CaptureError(f"the run's parameter {name!r} is not in the spec's model")
        want = [placement(c) for c in codes]
        if not is_dtensor(p):
            owner, _, leaf = name.rpartition(".")
            new = nn.Parameter(distribute_tensor(p.detach(), mesh, want), requires_grad=p.requires_grad)
            mods[owner].register_parameter(leaf, new)
            p = new
        have = [placement_code(x) for x in p.placements]  # type: ignore[attr-defined]
        if have != list(codes):
            raise CaptureError(f"{name}: rebuilt, it is placed {have}; the run placed it {list(codes)}")
    return model


class TensorParallel:
    """Tensor parallelism, the engine (``parallel.protocol.Engine``)."""

    name = "tensor_parallel"
    label = "tensor parallelism (DTensor parameters)"
    sharded = True
    monitored = True
    priority = 10
    shares_batch = True
    casts_inputs = False
    replay_requires = "torch.distributed.tensor.parallel"

    def holds(self, model: nn.Module) -> bool:
        return dtensor_holds(model)

    def read(self, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> BlockReader:
        return BlockReader([*params, *(p for _, p in named_parameters(model))], rank, world)

    recipe = staticmethod(recipe)
    assemble = staticmethod(assemble)
    refusal = staticmethod(refusal)
    rebuild = staticmethod(rebuild)

    def device_mesh(self, rec: dict[str, Any]) -> Any:
        return world_mesh(rec)

    def grad_scaler(self) -> type[torch.amp.GradScaler]:
        return torch.amp.GradScaler  # the ranks' gradients agree: a plain GradScaler


ENGINE: Engine = TensorParallel()


__all__ = ["ENGINE", "STYLES", "TensorParallel", "placement", "placement_code", "rebuild", "recipe", "refusal"]
