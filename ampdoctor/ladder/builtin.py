"""The rungs every triage knows: fp32, fp16 (raw ``model.half()``), amp (FP16 autocast + GradScaler), bf16."""

from __future__ import annotations

import torch

from ampdoctor.input.config import TriageConfig
from ampdoctor.ladder.registry import register
from ampdoctor.ladder.rung import Rung

FP32 = Rung("fp32")
FP16_MASTER = Rung("fp16", params=torch.float16, master=True)
"""Raw FP16 forward and backward (``model.half()``), FP32 master weights, no loss scaling."""
FP16_PURE = Rung("fp16", params=torch.float16, master=False)
"""Everything in FP16, the optimizer state too: what ``model.half()`` training does."""
AMP = Rung("amp", compute=torch.float16, scaler=True)
BF16 = Rung("bf16", compute=torch.bfloat16)


def fp16(config: TriageConfig) -> Rung:
    """Raw FP16: pure FP16 (as ``model.half()`` training does) when fp16 is the target, else FP32 master weights."""
    return FP16_PURE if config.target == "fp16" else FP16_MASTER


register("fp32", lambda config: FP32)
register("fp16", fp16)
register("amp", lambda config: AMP)
register("bf16", lambda config: BF16)
