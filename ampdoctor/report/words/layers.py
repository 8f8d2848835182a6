"""The ``layers`` command's sentences: what ``judge.ranges.advise`` found, worded (``report.layers_doc`` calls
these for the report document every renderer reads)."""

from __future__ import annotations

from ampdoctor.fmt import pow2
from ampdoctor.judge.ranges import KeepReason, Note, TensorAt, tensor_name

_WHAT = {"act": "output", "param": "weights"}
"""The kind of a module's own values, as the keep-in-higher-precision reasons name it."""


def tensor(t: TensorAt | None) -> str:
    """'gradient of head.weight (step 2)', 'output of module 0 (step 0)': the tensor that sets a limit."""
    if t is None:
        return "None"
    name = tensor_name(t.module, t.kind, t.param)
    if name.isdigit():  # Sequential children are named 0, 1, ...
        name = f"module {name}"
    what = {"act": f"output of {name}", "act_grad": f"gradient at {name}'s output", "param": name,
            "param_grad": f"gradient of {name}"}.get(t.kind, name)
    return f"{what} (step {t.step})"


def keep_reason(r: KeepReason) -> str:
    """Why a module should stay in higher precision: 'output overflow fp16', 'its matmul op reaches ...'."""
    if r.code == "overflow":
        return f"{_WHAT.get(r.kind, r.kind)} overflow {r.dtype}"
    if r.code == "underflow":
        return f"{_WHAT.get(r.kind, r.kind)} underflow {r.dtype} (> {r.tolerance:.0%})"
    if r.code == "no_scale":
        return "its gradients underflow at every scale that overflows nothing"
    return (f"its {r.op} op reaches {r.absmax:.4g} in FP32, beyond {r.dtype}'s max {r.max:g}, inside the module "
            "(its output fits)")


def note(n: Note) -> str:
    """A note on a format's advice, by its code."""
    if n.code == "fp32_nonfinite":
        return f"the FP32 reference already has NaN/Inf ({tensor(n.at)}): fix that first (ampdoctor triage names the cause)"
    if n.code == "no_scale_fits":
        return (f"no loss scale fits every gradient: {tensor(n.overflow)} overflows above {pow2(n.hi)} while "
                f"{tensor(n.underflow)} loses more than {n.tolerance:.0%} to underflow below {pow2(n.lo)}")
    return (f"layers measures module outputs and parameters only: no row shows the {n.op} op inside {n.module} "
            "(found by scanning the ops of the first step's forward); `ampdoctor triage` names the op that overflows")


HEADLINES = {
    "safe": ("safe for this model as is", "no overflow, underflow within {tol}"),
    "safe_with_scale": ("safe with a loss scale", "activations and weights fit"),
    "unsafe": ("not safe as is", ""),
    "fp32_nonfinite": ("cannot judge", "the FP32 reference itself has NaN/Inf"),
}
"""verdict → (headline, detail)."""


def headline(verdict: str, dtype: str, tolerance: float) -> tuple[str, str]:
    """(headline, detail) of a format's verdict: ('fp16: safe for this model as is', 'no overflow, underflow within 1%')."""
    head, detail = HEADLINES[verdict]
    return f"{dtype}: {head}", detail.format(tol=f"{tolerance:.0%}")


KEEP_HIGH = "keep in higher precision (FP32, or autocast(enabled=False)):"
NO_GRADIENT = "loss scale: no non-zero gradient; any init_scale works"
BF16_NO_SCALE = "loss scale: none needed (bf16 has FP32's exponent range)"


def loss_scale(scale: float, limit: str) -> str:
    """The loss scale to give GradScaler, and the gradient that limits it."""
    return (f"loss scale: GradScaler(init_scale={scale:g}), {pow2(scale)}, the largest power of "
            f"two that overflows no gradient; limited by the {limit}")


def window(lo: float, hi: float, tolerance: float, limit: str) -> str:
    """The loss-scale window every gradient allows, and the gradient that sets its lower end."""
    return (f"window: {pow2(lo)}..{pow2(hi)} keeps every gradient's underflow within {tolerance:.0%} "
            f"(lower end set by the {limit})")


def bf16(fixes: bool) -> str:
    """Whether bf16 removes the format's range problem."""
    return ("bf16: removes the range problem (it keeps 8 bits of precision: check accuracy)" if fixes
            else "bf16: does not remove the problem (run with --dtype bf16 to see where)")


__all__ = ["BF16_NO_SCALE", "HEADLINES", "KEEP_HIGH", "NO_GRADIENT", "bf16", "headline", "keep_reason", "loss_scale",
           "note", "tensor", "window"]
