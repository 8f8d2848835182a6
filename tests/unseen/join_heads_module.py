"""(a2) A convolutional multi-task net whose join is not the root's: a child module ``heads`` stacks a depth head
(Linear-GELU-Linear) and a segmentation head (Linear). The loss weighs the depth regression by 1e7 (depth in
millimetres against a cross-entropy in nats); its gradient w.r.t. the depth slice, 2e7 (d - t) / N, is beyond FP16's
65504 unscaled, while the class slice's is ~1/N. The gradient is non-finite where it enters the model (the output of
``heads``, whose own code only stacks); the head whose slice carries the inf is ``heads.depth`` (its last Linear,
``heads.depth.2``, returns that slice).

    ampdoctor triage tests/unseen/join_heads_module.py   # fp16_grad_overflow, module heads.depth.2, step 0
"""

import torch
from torch import nn
from torch.nn import functional as F


class Heads(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.depth = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 4))
        self.seg = nn.Linear(d, 4)

    def forward(self, h):
        return torch.stack([self.depth(h), self.seg(h)], dim=1)


class MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                                   nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.heads = Heads(32)

    def forward(self, x):
        return self.heads(self.trunk(x))


def build_model() -> nn.Module:
    torch.manual_seed(2)
    return MultiTask()


def build_dataloader():
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(5):
        x = torch.randn(16, 3, 12, 12, generator=g)
        depth = torch.rand(16, 4, generator=g) * 5.0
        cls = torch.randint(0, 4, (16,), generator=g)
        out.append((x, (depth, cls)))
    return out


def loss_fn(output, target):
    depth, cls = target
    out = output.float()
    return 1e7 * F.mse_loss(out[:, 0], depth) + F.cross_entropy(out[:, 1], cls)
