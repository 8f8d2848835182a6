"""Facts of the Monitor's save-time check and of its figures, turned into the messages the engine passes to
``ampdoctor.notify`` (the sentences live in ``report.words.check``)."""

from __future__ import annotations

from dataclasses import dataclass

from ampdoctor.report.words import check as words


@dataclass(frozen=True)
class SaveDamage:
    """A save is about to write a damaged state (``Monitor.saving``)."""

    path: str
    step: int | None
    """The first step that applied a non-finite update (None: the monitor saw none)."""
    reason: str
    """That step's reason (nonfinite_loss, nonfinite_grad:<module>...)."""
    nonfinite: tuple[str, ...]
    """The first tensors holding NaN/Inf in the state being saved."""
    count: int
    """How many tensors hold NaN/Inf."""
    last_step: int | None
    """The monitor's last step."""


def save_message(f: SaveDamage) -> str:
    return words.save_warning(f.path, f.step, f.reason, list(f.nonfinite), f.count, f.last_step)


def on_record_failed(exc: BaseException) -> str:
    return words.on_record_failed(type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


__all__ = ["SaveDamage", "on_record_failed", "save_message"]
