"""The words of the growth forecast (``engine.growth``): an op inside a module, a gradient or the loss on course to
pass the format's max, and what to change for each."""

from __future__ import annotations

from typing import Any

from ampdoctor.fmt import fixed, gen, num

WHAT = {
    "op": "the op {name} (inside the module: its output stays smaller)",
    "grad": "the gradient at {name}'s output (unscaled)",
    "pgrad": "the gradient of {name} (unscaled)",
    "loss": "the loss (an {fmt} tensor)",
}

FIXES = {
    "op": ["compute {op} in FP32 (cast its operands with .float(), or torch.autocast(..., enabled=False) around it) "
           "or keep {module} in FP32",
           "for attention logits: scale q before the product (q * d**-0.5) @ k^T, or normalise q and k (QK-norm) so "
           "the product cannot grow with the weights"],
    "grad": ["reduce the loss by its mean, not its sum (reduction='mean'), or divide it by the number of elements: "
             "the gradient at the output is then 1/N as large",
             "keep {module} and the loss in FP32, or train with BF16 autocast (FP32's range)"],
    "pgrad": ["average the loss over the tokens (reduction='mean'), so the weight gradient does not grow with the "
              "batch and sequence it is summed over; cap the sequence-length warm-up where it passes the max",
              "keep {module} in FP32, or train with BF16 autocast (FP32's range)"],
    "loss": ["compute the loss in FP32 (.float() before the reduction) and reduce it by its mean"],
}


def _g3(x: float) -> str:
    return num(float(x), 3)


def growth_message(kind: str, fc: Any, fmt_name: str, fmt_max: float) -> str:
    """The warning for one culprit (``judge.history.Forecast`` over its series): what grows, its headroom, the step
    it passes the format's max, and what to change."""
    name = fc.layer.rsplit(":", 1)[0] if kind != "op" else fc.layer
    module = name.split(" > ")[0] if kind == "op" else name.rsplit(".", 1)[0] if kind == "pgrad" else name
    op = name.split(" > ", 1)[1] if kind == "op" and " > " in name else name
    what = WHAT.get(kind, "{name}").format(name=name, fmt=fmt_name)
    when = (f"accelerating as it does, it passes the max at about step {fc.expected_step:,} (by step "
            f"{fc.latest_step:,} if it grew no faster than now)" if fc.expected_step < fc.latest_step else
            f"at that rate it passes the max by step {fc.latest_step:,}, sooner if the growth compounds")
    head = (f"ampdoctor: step {fc.step}: {what} is on course to overflow {fmt_name}: its largest |x| is "
            f"{_g3(fc.absmax)}, {fixed(fc.headroom, 1)} binade(s) below {fmt_name}'s max {gen(fmt_max)}, and grows "
            f"{_g3(fc.slope)} a step ({fixed(fc.binades_per_100, 2)} binade(s) of headroom per 100 steps); {when}")
    fixes = [f.format(op=op, module=module) for f in FIXES.get(kind, [])]
    return head + "".join(f"\n  {i}. {f}" for i, f in enumerate(fixes, 1))


__all__ = ["FIXES", "WHAT", "growth_message"]
