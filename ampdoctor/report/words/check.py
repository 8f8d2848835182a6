"""The sentences of ``ampdoctor check`` (``report.check`` hands them the codes and figures of
``judge.checkpoint_health``) and of the save-time warning (``report.alerts.SaveWarning``)."""

from __future__ import annotations

from ampdoctor.fmt import num, pow2

PARTS = {"weight": "weight", "exp_avg": "Adam exp_avg", "exp_avg_sq": "Adam exp_avg_sq",
         "max_exp_avg_sq": "Adam max_exp_avg_sq", "momentum_buffer": "SGD momentum"}


def part(p: str) -> str:
    return PARTS.get(p, p)


def nonfinite_parts(parts: list[tuple[str, int, int]]) -> str:
    """'NaN/Inf in the weight (32 of 32), Adam exp_avg (32 of 32)'."""
    return "NaN/Inf in " + ", ".join(f"{'the values' if p == 'weight' else part(p)} ({n} of {total})" for p, n, total in parts)


def issue(code: str, p: str, count: int, numel: int, value: float, dtype: str, target: str) -> str:
    """One damaged tensor, after its name: 'weight: 32 of 32 values NaN/Inf'."""
    share = f"{count} of {numel}"
    if code == "nonfinite":
        return nonfinite_parts([(p, count, numel)])
    if code == "out_of_range":
        return f"{share} values beyond {target}'s max (largest |x| {num(value, 3)}): inf once cast"
    if code == "v_flushed":
        return (f"Adam exp_avg_sq flushed to 0 in {share} values where exp_avg is not ({dtype}): "
                "the update m/(sqrt(v)+eps) blows up")
    if code == "moment_bound":
        return (f"Adam exp_avg beyond what exp_avg_sq allows in {share} values (|m| up to {num(value, 3)}x "
                "the bound C*sqrt(v)): a damaged moment")
    if code == "v_fell":
        return (f"Adam exp_avg_sq summed is {num(value, 3)}x the least the previous checkpoint's allows after {count} "
                "updates (v can fall by at most beta2 an update): the moments were reset or flushed")
    return scaler_issue(code, value, count)


def scaler_issue(code: str, scale: float, fell: int) -> str:
    if code == "scale_nonfinite":
        return f"GradScaler's scale is {num(scale)}: every scaled gradient is NaN/Inf"
    if code == "scale_zero":
        return "GradScaler's scale is 0: every scaled gradient is 0, nothing trains"
    if code == "scale_floor":
        return (f"GradScaler's scale is {pow2(scale)}, below FP32's smallest normal: at its floor (a few more "
                "back-offs make it 0)")
    fall = f", {fell} binades below the series' first" if fell else ""
    return (f"GradScaler's scale collapsed to {pow2(scale)}{fall}: the gradients overflow FP16 even unscaled")


SHORT = {"nonfinite": "NaN/Inf", "out_of_range": "beyond {target}", "v_flushed": "v flushed",
         "moment_bound": "moment bound", "v_fell": "v fell", "scale_nonfinite": "scale NaN/Inf", "scale_zero": "scale 0",
         "scale_floor": "scale at floor", "scale_collapsed": "scale collapsed"}


def summary(codes: dict[str, tuple[int, set[str]]], target: str, modules: list[str]) -> str:
    """The table's cell: 'NaN/Inf in 6 tensors (fc1, fc2, head); scale collapsed'."""
    parts = []
    for code, (n, _) in codes.items():
        what = SHORT.get(code, code).format(target=target)
        parts.append(what if code.startswith("scale") else f"{what} in {n} tensor{'s' if n != 1 else ''}")
    where = f" ({', '.join(modules[:3])}{', ...' if len(modules) > 3 else ''})" if modules else ""
    return "; ".join(parts) + where


def healthy(n_tensors: int, target: str, adam: bool, scale: float | None) -> str:
    extra = ", Adam moments consistent" if adam else ""
    sc = f", scale {pow2(scale)}" if scale is not None else ""
    return f"{n_tensors} tensors finite, weights within {target}{extra}{sc}"


def series(n: int, first_damaged: str | None, first_step: int | None, last_good: str | None, good_after: list[str],
           unreadable: int) -> str:
    """The verdict line over the series."""
    bad = f"; {unreadable} could not be read" if unreadable else ""
    if n == 1 and not unreadable:
        return "the checkpoint is healthy" if first_damaged is None else f"{first_damaged} is damaged: do not resume from it"
    if first_damaged is None:
        return (f"all {n} checkpoints are healthy" if not unreadable
                else f"no damage found in the {n - unreadable} checkpoint(s) read") + bad
    at = f" (step {first_step})" if first_step is not None else ""
    good = (f"last good: {last_good}: resume from it" if last_good is not None
            else "no good checkpoint before it: the first one is damaged already")
    again = f" ({', '.join(good_after[:3])} after it read healthy again)" if good_after else ""
    return f"first damaged: {first_damaged}{at}; {good}{again}{bad}"


def more_modules(n: int) -> str:
    return f"(+{n} more module{'s' if n != 1 else ''}: --json lists every one)"


def save_warning(path: str, step: int | None, reason: str, nonfinite: list[str], count: int, last_step: int | None) -> str:
    """The Monitor's warning when a save is about to write damage (``Monitor.saving``)."""
    where = f" to {path}" if path else ""
    what = []
    if nonfinite:
        more = f" (+{count - len(nonfinite)} more)" if count > len(nonfinite) else ""
        what.append(f"the state holds NaN/Inf in {', '.join(nonfinite)}{more}")
    if step is not None:
        what.append(f"step {step} applied a non-finite update ({reason})")
    elif nonfinite and last_step is not None:
        what.append(f"no step up to {last_step} applied a non-finite gradient the monitor saw: an optimizer step with "
                    "finite gradients overflowed the weights")
    return (f"ampdoctor: saving{where}: {'; '.join(what)}; this checkpoint is damaged: resuming from it fails again "
            "(`ampdoctor check` finds the last good one)")


def on_record_failed(name: str, text: str) -> str:
    return f"ampdoctor: on_record raised {name}: {text}; the figures are off for the rest of the run (the monitor goes on)"


__all__ = ["on_record_failed", "healthy", "issue", "nonfinite_parts", "more_modules", "part", "save_warning", "scaler_issue", "series", "summary"]
