"""The monitor's calls into ``capture.write``: arming it, keeping each step's batch, writing it at a failure.

What a capture holds and how it is written is ``capture.write``'s; this is when the monitor calls it and
with what: the settings it records, the scaler's state before the step, the lookback ring's tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampdoctor.capture.trigger import Trigger
from ampdoctor.capture.write import Capture, CaptureWarning
from ampdoctor.engine import growth
from ampdoctor.engine.monitor.config import MonitorConfig
from ampdoctor.engine.monitor.records import MonitorRecord
from ampdoctor.engine.step import Measured
from ampdoctor.input import origin
from ampdoctor.input.batches import Micro, as_micro, named_tensors
from ampdoctor.notify import alert
from ampdoctor.report import alerts as words
from ampdoctor.watch.ring import LAYERS_FILE, STEPS_FILE
from ampdoctor.watch.tap import ForwardTap, output_loss

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor


def arm(mon: Monitor, cfg: MonitorConfig, folder: str | Path) -> Capture:
    """The capture of ``folder`` (this rank's), with the settings a replay needs, and the tap that keeps the model's
    own inputs of each step's training forwards (the batch, without ``batch=``)."""
    settings = {"max_norm": cfg.max_norm, "window": cfg.window, "alert_rate": cfg.alert_rate,
                "alert_min_steps": cfg.alert_min_steps, "every": cfg.every, "activations": cfg.activations,
                "snapshot_every": cfg.snapshot_every, "step_convention": cfg.step_convention or "monitor"}
    amp = mon.amp_dtype
    cap = Capture(Path(folder), mon.model, mon.optimizer, mon.scaler, cfg.snapshot_every, cfg.capture_max_bytes, settings,
                  str(amp).replace("torch.", "") if amp is not None else None, quiet=cfg.quiet, sharded=mon.engine,
                  hold_bytes=cfg.capture_hold_bytes or 0,
                  layout=mon.recipe.shards.layout(mon.model) if mon.recipe.shards is not None else None)
    cap.step_starts(cfg.first_step)
    mon.tap = ForwardTap(mon.model, None, inputs=True, on_start=lambda: forward_starts(mon))
    mon.tap.on_error = mon._hook_failed
    return cap


def keep_batch(mon: Monitor, batch: Any) -> None:
    """Before the update: the step's batch (the one given, else the tap's), and a warning once if there is none."""
    cap = mon.capture
    if cap is None or cap.done:
        return
    taken = mon.tap.take() if mon.tap is not None else None
    # a plain list of as many micro-batches as the step's forwards (a loop that runs backward itself)
    b = as_micro(batch, len(taken) if isinstance(taken, Micro) else 1) if batch is not None else taken
    if not mon._batch_checked:
        mon._batch_checked = True
        if b is None or not named_tensors(b):
            alert(words.capture_without_batch(cap.path, mon.step_num), CaptureWarning, quiet=mon.quiet)
    cap.before_update(mon.step_num, b)


def seen_loss(mon: Monitor, loss: Any) -> None:
    """The first loss the loop hands over: how it was computed from the model's output (``input.origin.loss_recipe``,
    read from its autograd graph), so a spec-free replay of a plain model computes the run's loss; nothing when the
    model's own output is the loss. Reads the graph only; never raises."""
    growth.note_loss(mon.lookback, loss)  # (the loss's dtype, for the growth forecast)
    if mon.capture is None or mon.capture.done or mon._loss_seen:
        return
    mon._loss_seen = True
    try:
        tap = mon.tap
        last = tap._last() if tap is not None and tap._last is not None else None
        own = (tap is not None and tap.own_loss) or (last is not None and (last is loss or output_loss(last) is loss))
        mon._loss_recipe = {"fn": "model"} if own else origin.loss_recipe(loss)
    except Exception:  # a graph it cannot read: the replay asks for a spec's loss_fn
        mon._loss_recipe = None


def _extra(mon: Monitor, m: Measured, trig: Trigger) -> tuple[dict[str, Any], dict[str, str]]:
    """The manifest's extra fields (the scaler's phase, the ranks, the ring, the spike) and the ring's tables."""
    extra: dict[str, Any] = {"scaler_phase": mon._failing.phase,
                             "step_log": str(mon.log_path) if mon.log_path is not None else None}
    if mon._loss_recipe is not None:
        extra["loss_recipe"] = mon._loss_recipe  # (issue 45: a plain model's replay without a spec)
    if mon.fp8 is not None:
        extra["fp8"] = mon.fp8.recipe  # a torchao-converted model: its layers and casts (triage --from --target fp8)
    view = m.ranks
    if view is not None:
        first = view.first
        extra = {**extra, "ranks": view.column(), "first_rank": first.rank if first is not None else None,
                 "first_module": first.module if first is not None else None,
                 "others_clean": view.others_clean if first is not None else None}
    tables: dict[str, str] = {}
    lb = mon.lookback
    if lb is not None:
        tables[STEPS_FILE], tables[LAYERS_FILE] = lb.ring.tables()
        extra["ring"] = {"steps": lb.ring.capacity, "kept": min(lb.ring.count, lb.ring.capacity)}
        sp = lb.last_spike
        if sp is not None and trig.reason.endswith("_spike"):
            extra["spike"] = {"what": sp.what, "value": sp.value, "median": sp.median, "z": sp.z, "layers": sp.layers}
    return extra, tables


def write(mon: Monitor, rec: MonitorRecord, m: Measured, trig: Trigger, announce: bool) -> None:
    """Write the capture of a failing step (under torch.distributed: by the rank that went first, unless
    ``capture_ranks="all"``); ``rec.capture`` names its folder."""
    cap = mon.capture
    assert cap is not None
    view = m.ranks
    if view is not None:
        chosen = view.first.rank if view.first is not None else 0
        if mon.capture_ranks == "first" and mon.rank != chosen and mon.recipe.shards is None:
            cap.done = True  # this failing step is captured by rank `chosen`
            return
    extra, tables = _extra(mon, m, trig)
    before = None
    if mon.scaler is not None:
        before = dict(mon.scaler.state_dict())
        if m.scale is not None:
            before["scale"] = m.scale
        if m.growth_tracker is not None:
            before["_growth_tracker"] = m.growth_tracker
    out = cap.write(trig, step=rec.step, skipped=rec.skipped, record=rec.row(), stats=mon._last_stats,
                    scaler_before=before, extra=extra, announce=announce, tables=tables)
    if out is not None:
        rec.capture = str(out)


def step_done(mon: Monitor) -> None:
    """After a step's record: the tap goes once the capture is written, and the RNG is kept as the next step
    begins (a replay draws the run's)."""
    cap = mon.capture
    if cap is None:
        return
    if cap.done and mon.tap is not None:
        mon.tap.close()  # nothing more to keep
        mon.tap = None
    cap.step_starts(mon.step_num)


__all__ = ["arm", "keep_batch", "step_done", "write"]


def forward_starts(mon: Monitor) -> None:
    """A training forward starts: the capture marks the step's start (before its backward is known)."""
    if mon.capture is not None and mon._pending is None:
        mon.capture.step_starts(mon.step_num, forward=True)
