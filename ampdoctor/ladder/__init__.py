"""The precision ladder: each triage stage is a ``Rung`` (compute dtype, weight dtype, master weights, loss
scaling, model transform), registered by name; ``ladder(config)`` is what a triage runs, in order.

Importing the package registers the built-in rungs (``ladder.builtin``) and every rung module listed here."""

from ampdoctor.ladder import builtin, compile, fp8
from ampdoctor.ladder.builtin import AMP, BF16, FP16_MASTER, FP16_PURE, FP32
from ampdoctor.ladder.registry import ladder, register, registered, rung
from ampdoctor.ladder.rung import NONE, ModelTransform, NoTransform, Rung

__all__ = ["AMP", "BF16", "FP16_MASTER", "FP16_PURE", "FP32", "NONE", "ModelTransform", "NoTransform", "Rung", "builtin", "compile", "fp8",
           "ladder", "register", "registered", "rung"]
