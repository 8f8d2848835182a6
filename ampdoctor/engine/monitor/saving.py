"""The Monitor's save-time check: ``Monitor.saving(path)`` says once, when a save is about to write it, that the
state holds NaN/Inf or follows a step that applied a non-finite update, and which step did it. Observe only: the
save is neither blocked nor changed.

The Monitor's own record of its steps gives the step (``note``: the first step logged ``applied:<reason>``,
i.e. an update applied with a non-finite loss or gradient); the state itself (the model's weights and buffers,
the optimizer's state tensors, GradScaler's scale) is checked at the save, in one host copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ampdoctor.notify import say
from ampdoctor.records import StepRecord
from ampdoctor.report.saving import SaveDamage, save_message

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor

MAX_NAMED = 3


class Saves:
    """What the Monitor keeps for the save-time check."""

    def __init__(self) -> None:
        self.applied: tuple[int, str] | None = None
        """(step, reason) of the first step that applied a non-finite update."""
        self.warned = False

    def note(self, rec: StepRecord) -> None:
        if self.applied is None and not rec.skipped and rec.skip_reason.startswith("applied:"):
            self.applied = (rec.step, rec.skip_reason.split(":", 1)[1])


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2, tensor parallelism) local piece: each rank checks its own, with no collective."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tensors(mon: Monitor) -> list[tuple[str, torch.Tensor]]:
    """Weights, buffers, optimizer state tensors and the scale, read as they are (never ``state_dict()``, which is a
    collective under FSDP1)."""
    named = list(mon.model.named_parameters()) + list(mon.model.named_buffers())
    out = [(n, _local(t)) for n, t in named if isinstance(t, torch.Tensor) and t.is_floating_point()]
    opt = mon.optimizer
    if opt is not None:
        names = {id(p): n for n, p in mon.model.named_parameters()}
        for p, st in opt.state.items():
            for k, t in (st or {}).items():
                if isinstance(t, torch.Tensor) and t.is_floating_point() and k != "step":
                    out.append((f"{names.get(id(p), '?')} ({k})", _local(t)))
    sc = mon.scaler
    s = getattr(sc, "_scale", None) if sc is not None else None
    if isinstance(s, torch.Tensor):
        out.append(("GradScaler's scale", s))
    return out


def _nonfinite(pairs: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names whose tensor holds NaN/Inf, in one host copy (per device)."""
    by_dev: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for n, t in pairs:
        if t.numel():
            by_dev.setdefault(t.device, []).append((n, t))
    bad: list[str] = []
    for items in by_dev.values():
        flags = torch.stack([(~torch.isfinite(t.detach())).any() for _, t in items]).cpu().tolist()
        bad += [n for (n, _), f in zip(items, flags, strict=True) if f]
    return bad


def check(mon: Monitor, path: Any = None) -> str | None:
    """The warning for a save of the state now (said once a run), or None when the state is sound."""
    sv: Saves = mon.saves
    if sv.warned:
        return None
    bad = _nonfinite(_tensors(mon))
    if not bad and sv.applied is None:
        return None
    sv.warned = True
    step, reason = sv.applied if sv.applied is not None else (None, "")
    last = mon.last.step if mon.last is not None else None
    msg = save_message(SaveDamage(str(path) if path is not None else "", step, reason, tuple(bad[:MAX_NAMED]), len(bad), last))
    if mon.rank in (None, 0) or bad:
        say(msg, quiet=mon.quiet)
    return msg


__all__ = ["Saves", "check"]
