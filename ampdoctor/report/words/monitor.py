"""The Monitor's sentences: what it says from inside a training run (``report.alerts`` hands them the facts).

Every function takes figures and codes (``report.alerts``' facts) and returns the message the engine
passes to ``ampdoctor.notify``; numbers are formatted as the run's log has always shown them.
"""

from __future__ import annotations

import math
from typing import Any

from ampdoctor.records import LABELS


def ranks_story(rank: int, kind: str, module: str | None, others_clean: bool, spread: bool) -> tuple[str, str]:
    """(where, who) of the first rank that went non-finite: ' in embed', and what the other ranks did."""
    where = ": the batch's labels (the loss)" if module == LABELS else f" in {module}" if module else ""
    who = (f"the other ranks went non-finite later in the forward, through a collective: rank {rank}'s own "
           "computation" if spread else
           f"the other ranks were clean: rank {rank}'s own batch or forward" if others_clean
           else "other ranks saw it too: a range problem every rank shares")
    return where, who


def first_fault(step: int, rank: int, kind: str, module: str | None, others_clean: bool, ranks: str,
                spread: bool) -> str:
    """'step 5: rank 1 went non-finite first (input in embed); the other ranks were clean: ... [1:input:embed]'."""
    where, who = ranks_story(rank, kind, module, others_clean, spread)
    return f"step {step}: rank {rank} went non-finite first ({kind}{where}); {who} [{ranks}]"


def failure_what(reason: str, detail: str, loss: float, module: str | None, bad_count: int) -> str:
    """What failed at the run's first failing step, by its trigger (``capture.trigger.Trigger.reason``)."""
    if reason == "nonfinite_loss":
        return f"the loss is {loss:g}"
    if reason == "nonfinite_grad":
        return ("a gradient went non-finite" + (f", first in {module}" if module else "")
                + (f" ({bad_count} parameter(s))" if bad_count else ""))
    if reason == "nonfinite_update":
        return ("the update was applied with a non-finite gradient norm although GradScaler found no inf/NaN "
                "element (were overflowed values made finite, by a gradient hook's nan_to_num or a clamp?)")
    if reason == "hidden_overflow":
        return (f"a gradient went non-finite in backward, yet GradScaler found every parameter's finite and applied "
                f"the update: a gradient hook of the model made it finite ({detail})")
    if reason == "exploding_update":
        return f"the update exploded ({detail})"
    return f"the loss scale collapsed ({detail})"


def _ranks_together(together: list[tuple[int, str, str | None]]) -> str:
    """'; ranks 0 and 1 went non-finite at this step each on its own, none first (0: forward in attn; 1: ...)'."""
    ranks = [str(r) for r, _, _ in together]
    names = ", ".join(ranks[:-1]) + f" and {ranks[-1]}"
    each = "; ".join(f"{r}: {k}" + (" (the batch's labels)" if m == LABELS else f" in {m}" if m else "")
                     for r, k, m in together[:4])
    more = f"; +{len(together) - 4} more" if len(together) > 4 else ""
    return f"; ranks {names} went non-finite at this step each on its own, none first ({each}{more})"


def failure(step: int, what: str, skipped: bool, scale: float | None, first: tuple[int, str, str | None] | None,
            spread: bool, others_clean: bool, together: list[tuple[int, str, str | None]] | None = None) -> str:
    """'ampdoctor: step 154 failed: the loss is inf; the step was skipped at scale 65536' (+ the rank that went
    first: ``first`` is (rank, kind, module); ``together``: the ranks that each saw it in their own batch, forward
    or loss at this step, when there are several and none carried it to the others: none went first)."""
    done = "skipped" if skipped else "applied"
    at = f" at scale {scale:g}" if scale is not None else ""
    who = ""
    if together and len(together) > 1 and not spread:
        who = _ranks_together(together)
    elif first is not None:
        rank, kind, module = first
        where = ": the batch's labels (the loss)" if module == LABELS else f" in {module}" if module else ""
        who = (f"; rank {rank} went first ({kind}{where}), "
               + ("the other ranks went non-finite later in the forward, through a collective" if spread
                  else "the other ranks were clean" if others_clean else "other ranks saw it too"))
    return f"ampdoctor: step {step} failed: {what}; the step was {done}{at}{who}"


def spike_failure(spike_words: str, skipped: bool) -> str:
    """A spike's failure message: the spike, and what became of the step."""
    return f"{spike_words}; the step was {'skipped' if skipped else 'applied'}"


def skip_rate_alert(step: int, rate: float, window: int, alert_rate: float, reasons: list[tuple[str, int]], more: int,
                    log_path: str | None, scaler: bool) -> str:
    """The skip-rate alert: the rate over the window, its top reasons, where to read the log."""
    top = ", ".join(f"{r} x{c}" for r, c in reasons)
    log_hint = (f"read the step log with `ampdoctor scaler {log_path}`" if log_path is not None
                else "Monitor(log=...) keeps a step log for `ampdoctor scaler`")
    normal = "; GradScaler's calibration not counted" if scaler else ""
    return (f"ampdoctor: step {step}: {rate:.1%} of the last {window} steps were skipped (alert_rate "
            f"{alert_rate:.0%}{normal}); skip reasons: {top}{f' (+{more} more)' if more > 0 else ''}; {log_hint}")


def skip_rate_error(step: int, rate: float, window: int, max_skip_rate: float, over: int, last_skip: str) -> str:
    """``SkipRateError``'s message."""
    return (f"skip rate {rate:.1%} over the last {window} steps stayed above max_skip_rate={max_skip_rate:g} "
            f"for {over} steps (step {step}); last skip: {last_skip}. "
            "Run `ampdoctor scaler` on the step log, or `ampdoctor triage` on the model")


def monitor_off(why: str, rank: int | None) -> str:
    """'ampdoctor (rank 1): <why>; the monitor is off and the training goes on without it'."""
    where = f" (rank {rank})" if rank is not None else ""
    return f"ampdoctor{where}: {why}; the monitor is off and the training goes on without it"


def unsupported_engine(name: str) -> str:
    """Why the monitor is off under a sharding engine it cannot read (``monitor_off``'s ``why``)."""
    return f"{name} is not supported yet: ampdoctor cannot read its sharded gradients correctly, so it watches nothing of this run"


def unreadable_layout(problem: str) -> str:
    """Why the monitor is off under a sharded layout it cannot reduce (``monitor_off``'s ``why``)."""
    return f"{problem}: ampdoctor cannot read its sharded gradients correctly, so it watches nothing of this run"


def failed_at(where: str, step: int, exc_type: str, detail: str) -> str:
    """Why the monitor is off after a failure of its own (``monitor_off``'s ``why``)."""
    return f"{where} failed at step {step} ({exc_type}{': ' + detail if detail else ''})"


def rank_failed(rank: int, step: int) -> str:
    """Why every rank's monitor is off after one rank's failed (``monitor_off``'s ``why``)."""
    return (f"the monitor of rank {rank} failed (its warning says what), so every rank's is off "
            f"from step {step}")


def rank_alone(rank: int, world: int, timeout: float) -> str:
    """Not every rank built a Monitor within ``timeout`` seconds: this one exchanges nothing."""
    return (f"ampdoctor: rank {rank} of {world}: not every rank built a Monitor within {timeout:g} s, so this "
            "monitor does not exchange with the others (no first-rank column); put a Monitor on every rank, "
            "or pass Monitor(distributed=False) to skip this wait")


def sharded_no_exchange(name: str) -> str:
    return (f"ampdoctor: {name}: each rank holds a shard of the gradients and this monitor exchanges nothing with "
            "the other ranks (distributed=False), so the step log leaves the gradient norms out")


def sharded_plain_scaler(name: str) -> str:
    return (f"ampdoctor: {name} with a plain GradScaler: each rank decides its skip from its own shard of the "
            "gradients, so the ranks' loss scales can drift apart; use "
            "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which agrees across ranks")


def capture_without_batch(path: Any, step: int) -> str:
    return (f"ampdoctor: the capture armed at {path} has no batch to keep at step {step}: "
            "no batch= was passed and no training call of the model itself was seen; pass "
            "batch= to mon.step() or mon.after_backward(), or a failure cannot be replayed")


def skip_cause(why: str, need: float | None) -> str:
    """Why a skip is a failure and not GradScaler backing off (``capture.trigger.Trigger.why``), or ''."""
    if why == "unscaled":
        return "the gradients overflow FP16 unscaled, at a scale <= 1"
    if why == "jump" and need is not None:
        return f"a jump: the skips need the largest gradient {need:.3g}x the last applied step's"
    return ""


def skip_why(why: str, first: int, step: int, scale: float | None, need: float | None) -> str:
    """The failure message's account of a run of skips judged by the gradients: '' for another trigger."""
    cause = skip_cause(why, need)
    if not cause:
        return ""
    steps = f"steps {first}-{step} were skipped" if first < step else f"step {step} was skipped"
    at = f" down to scale {scale:g}" if scale is not None and why == "unscaled" else ""
    return f" ({steps}{at}; {cause})"


def skip_run_reason(reason: str) -> str:
    """What a later run of skips was, for a trigger other than the gradients' judgement."""
    return {"nonfinite_loss": "the loss is non-finite", "nonfinite_grad": "a gradient went non-finite"}.get(reason, "")


def skip_run(first: int, step: int, count: int, scale0: float | None, scale: float | None, why: str,
             since: tuple[int, int, int, float | None] | None = None) -> str:
    """A later run of skips judged a failure after the first failure was said: 'ampdoctor: steps 50-60 skipped
    (11 in a row); scale 32768 -> 16, 11 binade(s) down' (``scale``: after the last skip's back-off), and
    why on a line of its own. ``since`` (the 2nd, 4th, 8th... run said): the tally since the first failure,
    '  4 runs of skips since step 154's failure: 6 step(s) skipped, scale 65536 -> 1024', on a line between."""
    fell = ""
    if scale0 is not None and scale is not None and scale > 0:
        fell = f"; scale {scale0:g} -> {scale:g}, {math.log2(scale0 / scale):.0f} binade(s) down"
    steps = f"steps {first}-{step}" if first < step else f"step {step}"
    tally = ""
    if since is not None:
        at, runs, skipped, s_first = since
        down = f", scale {s_first:g} -> {scale:g}" if s_first is not None and scale is not None else ""
        tally = f"\n  {runs} runs of skips since step {at}'s failure: {skipped} step(s) skipped{down}"
    return f"ampdoctor: {steps} skipped ({count} in a row){fell}" + tally + (f"\n  {why}" if why else "")


__all__ = ["capture_without_batch", "failed_at", "failure", "failure_what", "first_fault", "monitor_off", "rank_failed",
           "ranks_story", "sharded_no_exchange", "sharded_plain_scaler", "skip_rate_alert", "skip_rate_error",
           "rank_alone", "skip_cause", "skip_run", "skip_run_reason", "skip_why", "spike_failure", "unreadable_layout", "unsupported_engine"]
