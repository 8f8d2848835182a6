"""The lookback ring's words: the forecast, the spike, and the story of the steps before a failure (its title, the
changes and the modules that moved most)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ampdoctor.fmt import fixed, gen
from ampdoctor.formats import FP16
from ampdoctor.records import Fix
from ampdoctor.report.words.common import g3, g4
from ampdoctor.report.words.fixes import fix_text


def forecast_message(fc: Any, fixes: list[Fix], more: int = 0) -> str:
    """The forecast warning (``judge.history.Forecast``): the layer, its headroom, its growth, the expected step,
    and the fixes triage gives for a forward overflow of that layer."""
    others = f" ({more} more layer(s) on the same course)" if more else ""
    head = (f"ampdoctor: step {fc.step}: {fc.layer} is on course to overflow FP16: its output's largest |x| is "
            f"{g3(fc.absmax)}, {fixed(fc.headroom, 1)} binade(s) below FP16's max {gen(FP16.max)}, and grows "
            f"{g3(fc.slope)} a step ({fixed(fc.binades_per_100, 2)} binade(s) of headroom per 100 steps); "
            + (f"accelerating as it does, it passes the max at about step {fc.expected_step:,} (by step "
               f"{fc.latest_step:,} if it grew no faster than now)" if fc.expected_step < fc.latest_step else
               f"at that rate it passes the max by step {fc.latest_step:,}, sooner if the growth compounds")
            + others)
    return head + "".join(f"\n  {i}. {fix_text(fx)}" for i, fx in enumerate(fixes, 1))


def spike_message(sp: Any) -> str:
    """'ampdoctor: step 412: loss spike: the loss 9.1 is 14.2 robust standard deviations above ...'."""
    what = {"loss": "the loss", "grad_norm": "the gradient norm"}.get(sp.what, sp.what)
    s = (f"ampdoctor: step {sp.step} failed: a {sp.what.replace('_', ' ')} spike: {what} {g4(sp.value)} is "
         f"{fixed(sp.z, 1)} robust standard deviations above the median {g4(sp.median)} of the steps before it")
    if sp.layers:
        s += "; update norms spiked first in " + ", ".join(
            f"{h['layer']} (step {h['step']}, {fixed(h['ratio'], 1)}x its median)" for h in sp.layers[:3])
    return s


_MOVER_FIG = {"absmax": "output |x|", "grad_norm": "gradient norm", "update_norm": "update norm"}


def change_text(c: Mapping[str, Any]) -> str:
    k = c["kind"]
    if k == "warmup_end":
        return f"the learning rate stopped rising at step {c['step']} (end of warm-up, lr {g3(c['lr'])})"
    if k == "input_size":
        return f"the model's input changed size at step {c['step']}: {gen(c['before'])} to {gen(c['after'])} elements"
    if k == "batch_spike":
        return (f"the batch of step {c['step']} spiked: its largest |x| {g3(c['value'])} against a median of "
                f"{g3(c['median'])} ({fixed(c['z'], 1)} robust sd)")
    if k == "loss_spike":
        return (f"the loss spiked at step {c['step']}: {g4(c['value'])} against a median of {g4(c['median'])} "
                f"({fixed(c['z'], 1)} robust sd)")
    return f"{k} at step {c.get('step')}"


def mover_text(m: Mapping[str, Any]) -> str:
    d = m["binades_at_end"]
    return (f"{m['layer']}: its {_MOVER_FIG.get(m['figure'], m['figure'])} left its baseline at step {m['left_step']} "
            f"and ended {fixed(abs(d), 1)} binade(s) {'above' if d > 0 else 'below'} it")


def history_title(ev: Mapping[str, Any]) -> str:
    """The story finding's title: the culprit's headroom over the kept steps, and where it crossed."""
    kept = f"the last {ev['steps_kept']} steps ({ev['first_step']}-{ev['fail_step']})"
    layer = ev.get("layer")
    if ev.get("data"):  # the batch's own NaN/Inf went through: no headroom ran out, and the title says so
        low, bad = ev.get("least_headroom"), ev.get("nonfinite_step")
        said = ([f"no layer came near FP16's max (least headroom {fixed(float(low['binades']), 1)} binade(s), "
                 f"{low['layer']})"] if low else []) + ([f"the values went non-finite at step {bad} with the batch, "
                                                         "not by an overflow"] if bad is not None else [])
        return f"Before the failure, over {kept}: " + ("; ".join(said) if said else "kept by the lookback ring")
    if not layer:
        return f"Before the failure: {kept} kept by the lookback ring"
    h0, h1 = ev.get("headroom_first", math.nan), ev.get("headroom_last", math.nan)
    cross = (f", and reached 0 at step {ev['crossed_step']}" if ev.get("crossed_step") is not None
             else ", and never reached 0 in the kept steps")
    return (f"Before the failure, over {kept}: {layer}'s FP16 headroom went from {fixed(float(h0), 1)} to {fixed(float(h1), 1)} "
            f"binade(s){cross}")


def history_lines(ev: Mapping[str, Any]) -> list[str]:
    """The story's figures as sentences: who moved first, and what changed."""
    out = []
    if ev.get("absmax_first") is not None and ev.get("absmax_peak") is not None and ev.get("layer"):
        out.append(f"{ev['layer']}'s largest |x|: {g3(ev['absmax_first'])} at step {ev['first_step']}, up to "
                   f"{g3(ev['absmax_peak'])} at step {ev['absmax_peak_step']} while finite (FP16's max {gen(FP16.max)})")
    movers = ev.get("movers") or []
    if movers:
        out.append("moved first: " + "; ".join(mover_text(m) for m in movers))
    ch = ev.get("changes") or []
    out.append("what changed: " + ("; ".join(change_text(c) for c in ch) if ch else
                                  "no warm-up end, new input size or spiking batch in the kept steps"))
    return out
