"""The Monitor's FP8 part: a model converted by torchao (``Float8Linear``) gets its per-GEMM statistics watched
(``engine.fp8_watch.Fp8Watch``): logged beside the step log (``<log>.fp8.csv``), kept in a ring, and its alerts
and forecast said once each (``Fp8Warning``). A model without Float8Linear layers gets nothing attached."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ampdoctor.engine.fp8_watch import Fp8Watch, log_path_for
from ampdoctor.notify import alert
from ampdoctor.report.fp8 import alert_words
from ampdoctor.watch.model_view import unwrap

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor


class Fp8Warning(UserWarning):
    """An FP8 GEMM operand of a converted model: a degenerate scale, saturation, a flushed share, or a forecast."""


def attach(mon: Monitor) -> Fp8Watch | None:
    """The watch of ``mon.model``'s Float8Linear layers (None: the model has none)."""
    cfg = mon.config
    return Fp8Watch.attach(unwrap(mon.model), log_path_for(mon.log_path), ring=cfg.ring or 256,
                           horizon=cfg.forecast_horizon or 1000)


def step_done(mon: Monitor, step: int) -> None:
    """The step's per-GEMM figures logged and kept; each new alert said once, by the rank that speaks."""
    watch: Fp8Watch | None = getattr(mon, "fp8", None)
    if watch is None:
        return
    for a in watch.end(step):
        if mon.rank in (None, 0):
            alert(alert_words(a.kind, a.step, a.module, a.operand, a.dtype, a.value), Fp8Warning, quiet=mon.quiet)


__all__ = ["Fp8Warning", "attach", "step_done"]
