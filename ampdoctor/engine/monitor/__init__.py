"""``Monitor``: watch a mixed-precision training loop step by step, in your own loop.

Two ways to use it::

    mon = Monitor(model, opt, scaler, log="steps.csv", max_norm=1.0)
    for x, y in data:
        with mon.autocast():
            loss = loss_fn(model(x), y)
        rec = mon.step(loss)            # backward, unscale_, clip, step (or skip), update, zero_grad
    mon.close()

or keep your own step and call two hooks::

    scaler.scale(loss).backward()
    mon.after_backward(loss)            # unscale_ (if you have not), norms, clip, statistics
    scaler.step(opt); scaler.update()
    mon.after_step()                    # writes the log row, skip rate, alerts
    opt.zero_grad(set_to_none=True)

The step ``Monitor.step`` runs, in PyTorch's AMP order:
loss finiteness check (on the device) → ``scaler.scale(loss).backward()`` → fault injection (if
asked) → ``scaler.unscale_(opt)`` → global L2 norm and clip (pre- and post-clip norms) →
**one copy to the host** → ``scaler.step(opt)`` (or ``opt.step()``), skipped when the loss or a
gradient is non-finite → ``scaler.update()``, on the skip path too → ``zero_grad(set_to_none=True)``.

Host synchronisations in a step:

- the monitor's own statistics (loss, norms, the scaler's found-inf flag, scale, growth tracker,
  the first non-finite parameter, and ``Hooks``' per-layer rows) come back in **one** copy, in
  ``after_backward``; ``after_step`` makes none. Nothing in a hook synchronises.
- ``GradScaler.step`` makes its own (``found_inf.item()``), only when the step is applied: on a
  skipped step the monitor already knows, and calls ``scaler.update()`` without ``scaler.step``.
- your optimizer may make its own (e.g. Adam's step counter on the CPU).

A non-finite loss is detected before backward but acted on at that one copy: backward still runs
(deciding earlier would cost a second sync), and the step is skipped all the same, with reason
``nonfinite_loss``; with a GradScaler the monitor adds it to the scaler's found-inf flag so the
scaler backs off as it does for an overflow.

The monitor reads GradScaler's device-side state (``_scale``, ``_growth_tracker``,
``_found_inf_per_device``) to avoid the syncs of ``get_scale()``; these fields have been stable
since PyTorch 1.6.

The monitor is this package's core (``monitor``: the ``Monitor`` class, its public methods and the step's order)
and one module per job: ``building`` (what a Monitor builds once its setup is known), ``failure`` (whether a step
failed, said once, captured), ``failsafe`` (turning off, the plain step once off), ``config`` (``MonitorConfig``: the keyword arguments, validated), ``records`` (the step's
record, its log columns, the warnings and errors), ``alerts`` (the skip rate, the first failure), ``injection``,
``sentinel`` (sentinel mode, the warm-up), ``capturing`` (the calls into ``capture.write``), ``exchange`` (the
distributed first fault), ``lookback`` (the ring) and ``history`` (skips, scales, ``state_dict``).
"""

from __future__ import annotations

from ampdoctor.engine.monitor.config import MonitorConfig
from ampdoctor.engine.monitor.monitor import Monitor
from ampdoctor.engine.monitor.records import (
    CAPTURE_COLUMNS,
    EXTRA_COLUMNS,
    RANK_COLUMNS,
    STATE_VERSION,
    STEP_COLUMNS,
    STEP_CONVENTIONS,
    FirstFault,
    MonitorOffWarning,
    MonitorRecord,
    SkipRateError,
    SkipRateWarning,
)

__all__ = ["CAPTURE_COLUMNS", "EXTRA_COLUMNS", "RANK_COLUMNS", "STATE_VERSION", "STEP_COLUMNS", "STEP_CONVENTIONS",
           "FirstFault", "Monitor", "MonitorConfig", "MonitorOffWarning", "MonitorRecord", "SkipRateError",
           "SkipRateWarning"]
