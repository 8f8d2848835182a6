"""The Monitor's figures in TensorBoard, for a loop of your own: ``Monitor(..., on_record=scalars(writer))``.

::

    from torch.utils.tensorboard import SummaryWriter
    from ampdoctor.integrations.tensorboard import scalars

    writer = SummaryWriter("runs/exp1")
    mon = ampdoctor.Monitor(model, opt, scaler, on_record=scalars(writer, every=10))

``writer`` is anything with ``add_scalar(tag, value, step)`` (``torch.utils.tensorboard.SummaryWriter``,
tensorboardX's); nothing here imports TensorBoard (``pip install ampdoctor[tensorboard]`` installs it).
The figures: ``engine.monitor.figures``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ampdoctor.errors import UsageError


def scalars(writer: Any, every: int = 1) -> Callable[[int, dict[str, float]], None]:
    """An ``on_record`` that writes the figures of every ``every``-th step with ``writer.add_scalar``."""
    if not callable(getattr(writer, "add_scalar", None)):
        raise UsageError(f"scalars(writer): takes a SummaryWriter (anything with add_scalar), got {type(writer).__name__}")
    if not isinstance(every, int) or every < 1:
        raise UsageError(f"scalars(every=...): a number of steps of at least 1, got {every!r}")

    def on_record(step: int, figures: dict[str, float]) -> None:
        if step % every == 0:
            for tag, value in figures.items():
                writer.add_scalar(tag, value, step)

    return on_record


__all__ = ["scalars"]
