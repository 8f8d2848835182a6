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


__all__ = ["keep_reason", "note", "tensor"]
