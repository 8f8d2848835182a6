"""A LoRA adapter whose B matrix starts at zero, cast to FP8 with no floor under amax: the scale is
448 / 0 = inf and the cast gives 0 * inf = NaN (pytorch/ao#3356).

LoRA initialises B to zeros so that the adapted model starts as the base model. B's amax is then 0. A scaled
FP8 cast computes ``scale = 448 / amax``: without a lower bound on amax that is inf, and ``B * scale`` is
``0 * inf`` = NaN in every element. torchao's training path (``Float8Linear``) bounds amax below by 1e-12;
its inference path for a frozen base with LoRA (``Float8DynamicActivationFloat8WeightConfig``) does not unless
``activation_value_lb`` is set, which is what ao#3356 hit. That path needs a CUDA GPU with FP8 (SM 8.9), so
this sample takes torchao's floor away (``float8_utils.EPS = 0``) to run the same arithmetic on the CPU.

    ampdoctor triage sample_models/fp8_degenerate_scale.py --target fp8  # verdict: fp8_degenerate_scale
"""

import torch
from torch import nn

try:  # the cast without an amax floor (see above); nothing changes when torchao is missing
    from torchao.float8 import float8_utils

    float8_utils.EPS = 0.0
except ImportError:
    pass


class LoraLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)  # the frozen pretrained weight
        self.lora_a = nn.Linear(n_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, n_out, bias=False)
        nn.init.zeros_(self.lora_b.weight)  # LoRA's init: the adapter adds nothing at first

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def build_model() -> nn.Module:
    return nn.Sequential(LoraLinear(16, 32), nn.GELU(), nn.Linear(32, 1))


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    return [(x, torch.tanh(x @ w)) for x in (torch.randn(32, 16, generator=g) for _ in range(8))]


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
