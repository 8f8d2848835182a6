"""The loss tap shared by the framework integrations (no framework needed)."""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor.integrations._attach import ForwardTap, inner_optimizer, output_loss


class WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.fc(x).pow(2).mean()}


def test_tap_reads_training_losses_once_and_ignores_evaluation() -> None:
    model = WithLoss()
    got: list[float] = []
    tap = ForwardTap(model, lambda loss: got.append(float(loss)), inputs=True)
    x = torch.ones(2, 4)
    model(x)
    with torch.no_grad():
        model(x)  # evaluation-style: not a training forward
    model.eval()
    model(x)
    model.train()
    assert len(got) == 1 and tap.take() is not None and tap.take() is None
    tap.close()
    model(x)
    assert len(got) == 1  # closed: nothing left on the process


def test_tap_sees_a_compiled_model_through_its_wrapper() -> None:
    model = WithLoss()
    nn.init.constant_(model.fc.weight, 0.5)  # the loss grows with the input whatever the RNG state (4, then 16)
    nn.init.zeros_(model.fc.bias)
    compiled = torch.compile(model, backend="eager")
    got: list[float] = []
    tap = ForwardTap(model, lambda loss: got.append(float(loss)), inputs=False)
    compiled(torch.ones(2, 4))
    compiled(torch.ones(2, 4) * 2)
    assert len(got) == 2  # inside dynamo the hook does nothing; the wrapper's call is seen, once each
    assert got[1] > got[0]
    tap.close()


def test_output_loss_and_inner_optimizer() -> None:
    assert output_loss({"loss": torch.tensor(1.0)}) is not None
    assert output_loss(torch.tensor(2.0)) is not None and output_loss(torch.ones(3)) is None
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)

    class Wrapper(torch.optim.Optimizer):  # accelerate's AcceleratedOptimizer is an Optimizer subclass too
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    assert inner_optimizer(Wrapper(opt)) is opt and inner_optimizer(opt) is opt and inner_optimizer(None) is None
