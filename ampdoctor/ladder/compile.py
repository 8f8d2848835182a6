"""The compile rung: the target's precision with the model under ``torch.compile``.

``CompileTransform(backend, emulate_precision_casts)`` compiles a copy of the model in place of its ``__call__``
(``nn.Module.compile``: parameter and module names stay the user's, without ``_orig_mod.``). The backends, in the
order a bisection tries them, are PyTorch's own: ``eager`` (Dynamo's graph capture, then the captured graph run as
it is), ``aot_eager`` (plus AOT autograd's forward/backward graphs, run op by op) and ``inductor`` (plus Inductor's
generated kernels); ``inductor`` with ``emulate_precision_casts`` rounds each fused intermediate to the low-precision
dtype as eager PyTorch does instead of keeping it in FP32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ampdoctor.input.config import TriageConfig
from ampdoctor.ladder.registry import register, rung
from ampdoctor.ladder.rung import Rung

BACKENDS = ("eager", "aot_eager", "inductor")
"""The backends a bisection tries, each one stage further into the compiler than the one before."""
STAGE_OF = {"eager": "graph_capture", "aot_eager": "aot_autograd", "inductor": "inductor_codegen"}
"""The compiler stage a backend adds to the one before it (where a failure that starts with it starts)."""


@dataclass(frozen=True)
class CompileTransform:
    """``torch.compile`` with ``backend`` on a copy of the model (``nn.Module.compile``)."""

    backend: str = "inductor"
    emulate_precision_casts: bool = False

    @property
    def name(self) -> str:
        return f"compile:{self.backend}" + ("+emulate_precision_casts" if self.emulate_precision_casts else "")

    def options(self) -> dict[str, Any] | None:
        return {"emulate_precision_casts": True} if self.emulate_precision_casts else None

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        out = copy.deepcopy(model)
        opts = self.options()
        if opts is not None:
            out.compile(backend=self.backend, options=opts)
        else:
            out.compile(backend=self.backend)
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "backend": self.backend, "emulate_precision_casts": self.emulate_precision_casts}


def compiled(base: Rung, backend: str = "inductor", emulate_precision_casts: bool = False) -> Rung:
    """``base`` (its dtypes, master weights and scaler) with the model compiled by ``backend``."""
    return replace(base, name="compile", transform=CompileTransform(backend, emulate_precision_casts))


def compile_rung(config: TriageConfig) -> Rung:
    """The target's rung, compiled with Inductor (the default backend of ``torch.compile``)."""
    return compiled(rung(config.target, config))


register("compile", compile_rung)


def is_compiled(model: Any) -> bool:
    """The model runs under ``torch.compile``: an ``OptimizedModule`` or a module compiled in place
    (``nn.Module.compile``), itself or inside a wrapper's ``.module`` (DDP, FSDP1, DeepSpeed's engine)."""
    seen = 0
    while isinstance(model, nn.Module) and seen < 8:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or getattr(model, "_compiled_call_impl", None) is not None:
            return True
        model, seen = getattr(model, "module", None), seen + 1
    return False


def compiled_run(manifest: dict[str, Any]) -> bool:
    """A capture's manifest says the run's model was compiled (``model_identity["compiled"]``)."""
    ident = manifest.get("model_identity")
    return isinstance(ident, dict) and ident.get("compiled") is True
