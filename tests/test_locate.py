"""The first-module rules on tiny real models, through the real hooks."""

from __future__ import annotations

import sys

import torch
from torch import nn

from ampdoctor.judge import locate
from ampdoctor.watch.hooks import Hooks


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        s = (q @ q.transpose(-2, -1)) * 1e6  # functional overflow inside attn, in FP16
        return self.out(torch.softmax(s.half(), dim=-1).float() @ q)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.attn = Attn()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.pre(x)))


def _step(model: nn.Module, x: torch.Tensor, loss_fn=lambda y: y.sum()):  # noqa: ANN001, ANN202
    with Hooks(model) as h:
        h.begin_step(0)
        y = model(x)
        loss_fn(y).backward()
        h.after_backward()
        return h.end_step()


def test_forward_overflow_in_functional_op_names_the_module_not_the_child() -> None:
    torch.manual_seed(0)
    st = _step(Net(), torch.randn(3, 4) * 100)
    assert locate.forward_fault(st)
    assert locate.locate_forward(st) == "attn"


def test_forward_fault_from_the_input_names_no_module() -> None:
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    st = _step(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)), x)
    assert locate.forward_fault(st)
    assert locate.locate_forward(st) is None
    assert locate.first_consumer_of_inputs(st) == "0"


class InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g * float("inf")


class Blowup(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InfGrad.apply(x)


def test_backward_fault_names_first_module_reached_with_finite_incoming_grad() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Blowup(), nn.Linear(4, 4), nn.Linear(4, 1))
    st = _step(model, torch.randn(2, 4))
    assert not locate.forward_fault(st)
    assert locate.backward_fault(st)
    assert locate.locate_backward(st) == "1"
    # backward reaches the head first
    assert locate.backward_order(st)[0] == "3"


def test_gradient_already_inf_from_the_loss_names_the_output_module() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    st = _step(model, torch.randn(2, 4), loss_fn=lambda y: (y * float("inf")).sum() * 0 + InfGrad.apply(y).sum())
    assert locate.locate_backward(st) == "2"


def test_innermost_and_ancestry() -> None:
    assert locate.innermost(["<model>", "a", "a.b", "c"]) == ["a.b", "c"]
    assert locate.is_ancestor("a", "a.b") and not locate.is_ancestor("a", "ab")


def test_hooks_are_removed_and_mode_restored_even_on_error() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(2, 2), Boom())
    model.eval()
    try:
        with Hooks(model) as h:
            model.train()
            h.begin_step(0)
            model(torch.randn(1, 2))
    except RuntimeError:
        pass
    assert all(not m._forward_hooks for m in model.modules())
    assert model.training is False


def test_one_host_copy_per_step(monkeypatch) -> None:  # noqa: ANN001
    """One host copy a step: ``cpu`` and ``numpy`` calls count once per calling frame (on the CPU the rows and the
    scalars are read where they lie, two ``numpy`` calls in one place: one copy)."""
    calls = {"n": 0}
    frames: set[int] = set()
    real_cpu, real_numpy = torch.Tensor.cpu, torch.Tensor.numpy

    def read(real):  # noqa: ANN001, ANN202
        def counting(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            f = id(sys._getframe(1))
            if f not in frames:
                frames.add(f)
                calls["n"] += 1
            return real(self, *a, **k)
        return counting

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    with Hooks(model) as h:
        for step in range(3):
            h.begin_step(step)
            loss = model(torch.randn(4, 8)).pow(2).mean()
            h.add_scalar("loss", loss)
            monkeypatch.setattr(torch.Tensor, "cpu", read(real_cpu))
            monkeypatch.setattr(torch.Tensor, "numpy", read(real_numpy))
            monkeypatch.setattr(torch.Tensor, "item", lambda self: (_ for _ in ()).throw(AssertionError("item() called")))
            loss.backward()
            h.after_backward()
            h.after_step()
            before = calls["n"]
            frames.clear()
            st = h.end_step()
            monkeypatch.undo()
            assert calls["n"] - before == 1
            assert abs(st.extra["loss"] - float(loss.detach())) < 1e-6
            assert len(st.pgrad) == 12 and len(st.param) == 12
