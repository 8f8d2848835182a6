"""A gradient hook that makes an overflow finite (``nan_to_num``, a ``where(isfinite, g, 0)``) hides it from
GradScaler, which then applies the step. From the definition: the FP16 gradient is non-finite when the hook is
handed it, GradScaler sees no inf, and the update is applied. The Monitor captures such a step (a non-finite
gradient recorded in backward on a model with hooks, or an applied norm that is non-finite), the capture names
the hooks, and the replay names the hook as the cause (``amp_misuse``, variant ``hook_hid_overflow``), never
``model_bug``. Two models: an MLP with parameter ``register_hook``s, a conv net with a module full backward hook."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor import Monitor, triage
from ampdoctor.capture.trigger import FailingStep
from ampdoctor.watch import userhooks

MLP_SPEC = '''
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build_model():
    torch.manual_seed(0)
    model = MLP()
    if HOOKS:
        for p in model.parameters():
            p.register_hook(lambda g: torch.nan_to_num(g))  # "guard against NaN"
    return model


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    # a curriculum: from step 40 the targets are 300x larger; at GradScaler's 2^16 their gradients overflow FP16
    return [(torch.randn(16, 8, generator=g), 0.1 * torch.randn(16, 1, generator=g) * (300.0 if s >= 40 else 1.0))
            for s in range(44)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-2)
'''

SEQ_SPEC = '''
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    for p in m.parameters():
        p.register_hook(lambda g: torch.nan_to_num(g))  # inf becomes float32's max: a huge update is applied
    return m


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(30)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-2)
'''

CONV_SPEC = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 4)
        with torch.no_grad():  # a head far larger than its tiny input: the gradient at its input overflows at 2^16
            self.head.weight.mul_(400.0)
            self.features[0].weight.mul_(0.01)
            self.features[0].bias.mul_(0.01)

    def forward(self, x):
        return self.head(self.features(x))


def _finite(module, grad_input, grad_output):
    return tuple(torch.where(torch.isfinite(g), g, torch.zeros_like(g)) if g is not None else None for g in grad_input)


def build_model():
    torch.manual_seed(0)
    net = Net()
    net.head.register_full_backward_hook(_finite)
    return net


def build_dataloader():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-6)
'''


def _write(tmp: Path, name: str, text: str, hooks: bool = True) -> Path:
    p = tmp / name
    p.write_text(text.replace("if HOOKS:", f"if {hooks}:"))
    return p


def _run(spec: Path, cap: Path, snapshot_every: int = 10) -> tuple[Monitor, list]:  # type: ignore[type-arg]
    ns = runpy.run_path(str(spec))
    model = ns["build_model"]()
    opt = ns["build_optimizer"](model.parameters())
    sc = torch.amp.GradScaler("cpu")  # GradScaler's defaults
    recs = []
    with Monitor(model, opt, sc, capture=cap, snapshot_every=snapshot_every, quiet=True) as mon:
        for x, y in ns["build_dataloader"]():
            with mon.autocast():
                loss = ns["loss_fn"](model(x), y)
            recs.append(mon.step(loss, batch=(x, y)))
    return mon, recs


# the pieces ---------------------------------------------------------------------------------------------------

def test_hooks_are_found_by_name_taken_off_and_probed_before_they_run() -> None:
    lin = nn.Linear(3, 2)
    handles = [p.register_hook(lambda g: torch.nan_to_num(g)) for p in lin.parameters()]  # noqa: AMP004
    seq = nn.Sequential(lin, nn.ReLU())
    seq.register_full_backward_hook(lambda m, gi, go: None)
    got = userhooks.found(seq)
    assert [(h.kind, h.target, h.name) for h in got] == [
        ("full backward hook", "module", "<model>"), ("gradient hook", "parameter", "0.weight"),
        ("gradient hook", "parameter", "0.bias")]
    assert got[1].ops == ["nan_to_num"] and got[1].where.startswith("test_hook_hid.py:")
    x = torch.rand(4, 3) + 0.1

    def grad_w() -> torch.Tensor:
        lin.zero_grad(set_to_none=True)
        (lin(x).sum() * 1e38 * 10).backward()  # d/dW = inf * x: inf in every element
        assert lin.weight.grad is not None
        return lin.weight.grad

    assert bool(torch.isfinite(grad_w()).all())  # the hook made the infs float32's max
    with userhooks.disabled(seq) as n:
        assert n == 3 and not bool(torch.isfinite(grad_w()).any())
    assert bool(torch.isfinite(grad_w()).all())  # put back
    probe = userhooks.Probe(seq)
    assert probe.attach() == 3
    assert bool(torch.isfinite(grad_w()).all())  # the probe writes nothing
    assert probe.take()[:2] == ["0.bias", "0.weight"]  # it saw the gradient before the user's hook did
    probe.detach()
    handles[0].remove()  # the user's own handle still removes the hook after the probe reordered the dict
    assert not bool(torch.isfinite(grad_w()).all())


def test_failing_step_applied_updates() -> None:
    rule = FailingStep()
    assert rule.judge(skipped=False, reason="", scale=2.0**16, alert=False, norm=1.0) is None
    t = rule.judge(skipped=False, reason="", scale=2.0**16, alert=False, norm=math.inf)
    assert t is not None and t.reason == "nonfinite_update"
    rule = FailingStep()
    for _ in range(8):
        assert rule.judge(skipped=False, reason="", scale=1024.0, alert=False, norm=2.0) is None
    assert rule.judge(skipped=False, reason="", scale=1024.0, alert=False, norm=1900.0) is None  # 950x: not yet
    t = rule.judge(skipped=False, reason="", scale=1024.0, alert=False, norm=2500.0)
    assert t is not None and t.reason == "exploding_update" and "1.25e+03x" in t.detail
    t = FailingStep().judge(skipped=False, reason="", scale=1024.0, alert=False, hidden="gradient hook h on parameter w")
    assert t is not None and (t.reason, t.detail) == ("hidden_overflow", "gradient hook h on parameter w")
    # fewer than 8 applied norms: nothing to compare with
    assert FailingStep().judge(skipped=False, reason="", scale=1.0, alert=False, norm=1e9) is None


# end to end ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_nan_to_num_hook_is_named_as_the_cause_of_a_late_failure(tmp_path: Path) -> None:
    spec = _write(tmp_path, "mlp_spec.py", MLP_SPEC)
    cap = tmp_path / "cap"
    mon, recs = _run(spec, cap)
    assert mon.first_failure == (40, "hidden_overflow")
    assert [r.step for r in recs if r.capture] == [40] and not any(r.skipped for r in recs)  # GradScaler saw nothing
    m = json.loads((cap / "manifest.json").read_text())
    assert m["reason"] == "hidden_overflow" and "state.pt" not in m["files"] and m["snapshot_step"] == 40
    assert [(h["name"], h["ops"]) for h in m["user_hooks"]] == [(n, ["nan_to_num"]) for n in
                                                               ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
    report, _ = triage(spec, from_capture=cap)
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step) == ("amp_misuse", "fc2", 40)
    assert "hid an overflow from GradScaler at step 40" in v.summary and "nan_to_num" in v.summary
    assert "gradient hook <lambda>" in report.fixes[0] and "mlp_spec.py:" in report.fixes[0]
    assert any("the replay keeps 4" in n for n in report.notes)
    # the same capture, replayed by a spec whose model does not register the hooks: they are listed as not re-created
    bare = _write(tmp_path, "bare_spec.py", MLP_SPEC, hooks=False)
    report2, _ = triage(bare, from_capture=cap)
    assert any("4 of the run's gradient hook(s) were not re-created" in n for n in report2.notes)
    assert report2.verdict.cause != "model_bug"


@pytest.mark.slow
def test_a_huge_applied_update_replays_from_the_snapshot_before_it(tmp_path: Path) -> None:
    # nan_to_num makes the overflowed gradients float32's max: the update applied at step 25 has a non-finite norm;
    # triaged from the step after it (the ruined weights), FP32 fails too: that was model_bug
    spec = _write(tmp_path, "seq_spec.py", SEQ_SPEC)
    cap = tmp_path / "cap"
    mon, recs = _run(spec, cap, snapshot_every=20)
    assert mon.first_failure is not None and mon.first_failure[0] == 25
    assert recs[25].capture and not recs[25].skipped and math.isinf(recs[25].grad_l2_pre_clip)
    m = json.loads((cap / "manifest.json").read_text())
    assert (m["snapshot_step"], m["batch_steps"]) == (20, [20, 21, 22, 23, 24, 25]) and "state.pt" not in m["files"]
    report, _ = triage(spec, from_capture=cap)
    v = report.verdict
    assert (v.cause, v.first_step) == ("amp_misuse", 25) and v.first_module == "2"
    assert "nan_to_num" in v.summary and "gradient norm inf" in v.summary


def test_a_module_full_backward_hook_is_named(tmp_path: Path) -> None:
    spec = _write(tmp_path, "conv_spec.py", CONV_SPEC)
    from ampdoctor import TriageConfig

    report, _ = triage(spec, TriageConfig(steps=4))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step) == ("amp_misuse", "head", 0)
    assert "full backward hook _finite" in v.summary and "the gradient entering head" in v.summary
    amp = next(s for s in report.stages if s.name == "amp")
    assert amp.skipped_steps == []  # GradScaler never saw it
