"""A model that computes its own loss in forward (as CTC and Hugging Face heads do), by hand.

``forward(x, labels)`` returns ``{"loss", "logits"}`` with a sigmoid-then-log BCE. The logits
are finite in FP16, but sigmoid rounds to exactly 1.0 in FP16 above x ≈ 8.3 and log(1 - p) is
-inf: the loss is the first non-finite value, inside the root's forward. The answer is the loss
(module None) with the op named, not the whole model.

    ampdoctor triage sample_models/model_loss.py   # verdict: fp16_forward_overflow, module None (op: log)
"""

import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            self.head.weight.mul_(12.0)

    def forward(self, x, labels=None):
        logits = self.head(self.body(x))
        out = {"logits": logits}
        if labels is not None:
            p = torch.sigmoid(logits)
            out["loss"] = -(labels * torch.log(p) + (1 - labels) * torch.log(1 - p)).mean()
        return out


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Classifier()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, generator=g)
    out = []
    for _ in range(6):
        x = torch.randn(64, 16, generator=g)
        out.append({"x": x, "labels": (x @ w > 0).float().unsqueeze(1)})
    return out
