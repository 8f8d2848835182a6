"""DeepSpeed ZeRO-1/2 as a parallel engine (``parallel.protocol.Engine``): where a rank's pieces sit.

ZeRO keeps the FP32 master weights and the optimizer state in flat partitions, one per parameter group and
rank; a parameter's piece on this rank is elements ``flat ..`` of the flattened parameter (``_hp_mapping``'s
fragment address), possibly empty. ``Layout`` reads them with no collective (what a rank's capture holds, the
manifest's ``shards.model`` and ``optimizer_params``), ``fragment`` a rank's piece of a reduced gradient, and
``layout_optimizer`` the ``torch.optim`` optimizer a replay rebuilds DeepSpeed's as. The wrapping of DeepSpeed's
engine (its backward and step, the loss scaler, the Monitor) is ``integrations.deepspeed``'s. A capture
reassembles on one process without DeepSpeed; DeepSpeed's own engine is not recorded, so it is not rebuilt on N.
Nothing here imports DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import CaptureError
from ampdoctor.parallel.pieces import BlockReader, assemble, module_kinds, world_mesh
from ampdoctor.parallel.protocol import Engine


def torch_class(inner: Any) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class a replay rebuilds DeepSpeed's optimizer as (its own FusedAdam / CPU Adam
    compute Adam or AdamW: ``adam_w_mode``)."""
    cls = type(inner)
    if cls.__module__.startswith("torch.optim") and issubclass(cls, torch.optim.Optimizer):
        return cls
    name = cls.__name__.lower()
    if "adam" in name:
        return torch.optim.AdamW if getattr(inner, "adam_w_mode", True) else torch.optim.Adam
    return torch.optim.SGD if "sgd" in name else torch.optim.AdamW


_HYPER_SKIP = ("params", "foreach", "fused", "capturable", "differentiable", "torch_adam", "adam_w_mode",
               "bias_correction", "initial_lr")


class Layout:
    """Which of the model's parameters sits where in DeepSpeed's flat FP32 partitions, on this rank."""

    def __init__(self, engine: Any, names: dict[int, str]) -> None:
        self.engine = engine
        opt = engine.optimizer
        self.opt = opt
        self.groups: list[list[tuple[str, nn.Parameter]]] = [[(names[id(p)], p) for p in g] for g in opt.bit16_groups]
        self.order = [n for g in self.groups for n, _ in g]
        """The optimizer's parameters, in the order of its state's indices (the manifest's ``optimizer_params``)."""

    def hyper(self) -> list[dict[str, Any]]:
        out = []
        for g in self.opt.optimizer.param_groups:
            h: dict[str, Any] = {}
            for k, v in g.items():
                if k in _HYPER_SKIP:
                    continue
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    v = v.item()
                if isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v):
                    h[k] = list(v)
                elif isinstance(v, (bool, int, float, str)) or v is None:
                    h[k] = v
            out.append(h)
        return out

    def pieces(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[int, dict[str, Any]]]:
        """(this rank's piece of each FP32 master weight, where it sits, the optimizer state's pieces by index).

        A piece is elements ``flat ..`` of the flattened parameter, in DeepSpeed's FP32 master partition; a
        parameter with no element on this rank gets an empty piece."""
        inner = self.opt.optimizer
        model: dict[str, torch.Tensor] = {}
        where: dict[str, Any] = {}
        state: dict[int, dict[str, Any]] = {}
        i = 0
        for gi, group in enumerate(self.groups):
            flat = self.opt.single_partition_of_fp32_groups[gi]
            st = inner.state.get(flat, {})
            for name, p in group:
                hm = getattr(p, "_hp_mapping", None)
                shape = [int(x) for x in p.shape]
                if hm is None:
                    model[name] = torch.zeros(0, dtype=torch.float32)
                    where[name] = {"shape": shape, "flat": 0}
                else:
                    a = hm.hp_fragment_address
                    model[name] = flat.detach().narrow(0, a.start, a.numel)
                    where[name] = {"shape": shape, "flat": int(hm.lp_fragment_address.start)}
                if st:
                    ps: dict[str, Any] = {}
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor) and v.shape == flat.shape:
                            ps[k] = (v.detach().narrow(0, hm.hp_fragment_address.start, hm.hp_fragment_address.numel)
                                     if hm is not None else torch.zeros(0, dtype=v.dtype))
                        elif isinstance(v, torch.Tensor) and v.numel() == 1:
                            ps[k] = v.detach()
                        elif isinstance(v, (int, float)):
                            ps[k] = v
                    state[i] = ps
                i += 1
        return model, where, state


def fragment(p: nn.Parameter) -> tuple[torch.Tensor | None, int]:
    """This rank's fragment of ``p``'s reduced gradient (FP32, flat) and where it starts in the flattened
    parameter; (None, 0) when this rank holds none of it."""
    hm = getattr(p, "_hp_mapping", None)
    if hm is None:
        return None, 0
    a = hm.lp_fragment_address
    frag = hm.get_lp_grad_fragment(getattr(p, "_index_in_param_group")).to(torch.float32).flatten()  # noqa: B009
    if frag.numel() == p.numel() and a.numel != p.numel():  # a whole-parameter buffer: only this rank's fragment counts
        frag = frag.narrow(0, a.start, a.numel)
    return frag, int(a.start)


def layout_optimizer(engine: Any, lay: Layout) -> torch.optim.Optimizer:
    """A ``torch.optim`` optimizer over the model's parameters with DeepSpeed's groups and hyperparameters,
    never stepped: the capture's ``optimizer_layout`` (what the replay rebuilds without a spec's optimizer)."""
    cls = torch_class(engine.optimizer.optimizer)
    groups = [{"params": [p for _, p in g], **{k: tuple(v) if isinstance(v, list) else v for k, v in h.items()
                                               if k in _accepted(cls)}}
              for g, h in zip(lay.groups, lay.hyper(), strict=False)]
    return cls(groups)  # type: ignore[call-arg]


def _accepted(cls: type) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(cls).parameters) - {"params"}
    except (TypeError, ValueError):  # pragma: no cover
        return set()


class Reader(BlockReader):
    """A rank's pieces of a ZeRO-1/2 model: its fragment of each parameter's flat FP32 partition (``flat``
    entries); a parameter without one here counts nowhere on this rank."""

    def counts(self, p: torch.Tensor) -> bool:
        return getattr(p, "_hp_mapping", None) is not None

    def piece(self, t: torch.Tensor) -> dict[str, Any]:
        hm = getattr(t, "_hp_mapping", None)
        if hm is None:
            return super().piece(t)
        return {"shape": [int(x) for x in t.shape], "flat": int(hm.lp_fragment_address.start)}


class DeepSpeed:
    """DeepSpeed ZeRO, the engine (``parallel.protocol.Engine``)."""

    name = "deepspeed"
    label = "DeepSpeed"
    sharded = True
    monitored = False
    priority = 40
    shares_batch = False
    casts_inputs = False
    replay_requires = ""

    def holds(self, model: nn.Module) -> bool:
        return "DeepSpeedEngine" in module_kinds(model)

    def read(self, model: nn.Module, params: Sequence[torch.Tensor], rank: int, world: int) -> Reader:
        return Reader([], rank, world)

    def recipe(self, model: nn.Module) -> dict[str, Any] | None:
        return None  # DeepSpeed's engine is not recorded

    assemble = staticmethod(assemble)

    def refusal(self, rec: dict[str, Any]) -> str | None:
        return "DeepSpeed's engine is not recorded (a DeepSpeed capture reassembles on one process)"

    def device_mesh(self, rec: dict[str, Any]) -> Any:
        return world_mesh(rec)

    def rebuild(self, model: nn.Module, rec: dict[str, Any], mesh: Any, low: bool) -> nn.Module:
        raise CaptureError(f"the run's layout cannot be rebuilt: {self.refusal(rec)}")

    def grad_scaler(self) -> type[torch.amp.GradScaler]:
        return torch.amp.GradScaler


ENGINE: Engine = DeepSpeed()

__all__ = ["ENGINE", "DeepSpeed", "Layout", "Reader", "fragment", "layout_optimizer", "torch_class"]
