"""The first op in backward: ``judge.gradnode`` names the autograd node whose output gradient is first non-finite, the
forward op and line that made it and the module running it; triage adds it to a gradient verdict."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from ampdoctor import TriageConfig, triage
from ampdoctor.judge.gradnode import first_nonfinite_grad

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent / "grad_nodes"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _line(path: Path, text: str) -> str:
    lines = path.read_text().splitlines()
    return f"{path.name}:{next(i for i, s in enumerate(lines, 1) if text in s)}"


def test_a_scaled_gradient_overflows_where_it_is_cast_back_to_fp16() -> None:
    # the loss weighs a sum by 1e7 and runs on out.float(): FP32 holds its gradient, the cast back to the FP16 output
    # of head (ToCopyBackward0, the backward of .float()) cannot, at GradScaler's 2^16 and unscaled alike
    path = ROOT / "sample_models" / "grad_overflow.py"
    g = _load(path)
    model = g.build_model()
    x, y = g.build_dataloader()[0]

    def run() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return g.loss_fn(model(x), y)

    for scale in (65536.0, 1.0):
        node = first_nonfinite_grad(model, run, scale)
        assert node is not None
        assert (node.node, node.op, node.module, node.line, node.summed, node.nan) == (
            "ToCopyBackward0", "float", None, _line(path, "output.float()"), False, False)
    assert all(p.grad is None for p in model.parameters())  # the replay leaves no gradient behind
    assert first_nonfinite_grad(model, lambda: g.loss_fn(model(x), y)) is None  # FP32 holds it


def test_a_zero_distance_names_sqrt_in_the_module_that_computes_it() -> None:
    path = HERE / "zero_norm.py"
    z = _load(path)
    model = z.build_model()
    x, y = z.build_dataloader()[0]
    node = first_nonfinite_grad(model, lambda: z.loss_fn(model(x), y))
    assert node is not None
    assert (node.node, node.op, node.module, node.line, node.nan) == ("SqrtBackward0", "sqrt", "geometry",
                                                                      _line(path, ".sqrt()"), False)


class _TwoReaders(nn.Module):
    """``h`` is read by two products whose FP16 gradients fit (4e4 each) and whose sum does not (8e4); ``h`` is 0 (zero
    weights), so the forward stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).half()
        nn.init.zeros_(self.lin.weight)
        nn.init.zeros_(self.lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h * 40000.0).sum() + (h * 40000.0).sum()


def test_a_sum_of_finite_gradients_that_overflows_is_said_as_a_sum() -> None:
    model = _TwoReaders()
    node = first_nonfinite_grad(model, lambda: model(torch.ones(2, 4, dtype=torch.float16)).float())
    assert node is not None and node.summed and node.op == "linear" and node.module == "lin"


def test_no_node_when_the_backward_is_finite_or_the_loss_already_is_not() -> None:
    model = nn.Linear(3, 1)
    x = torch.randn(5, 3)
    assert first_nonfinite_grad(model, lambda: model(x).pow(2).mean()) is None
    assert first_nonfinite_grad(model, lambda: (model(x) * float("inf")).mean()) is None  # a forward fault
    assert first_nonfinite_grad(model, lambda: (_ for _ in ()).throw(RuntimeError("user code"))) is None


@pytest.mark.slow  # a fresh process and a process group: ~20 s at this machine's load
def test_under_dtensor_the_node_is_named_where_detect_anomaly_raises() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(HERE / "dtensor_tp.py"), str(port)], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.splitlines()
    assert "weight DTensor" in out
    assert f"node SqrtBackward0 sqrt <model> {_line(HERE / 'dtensor_tp.py', '.sqrt()')}" in out


@pytest.mark.parametrize(("spec", "cause", "module", "node", "text"), [
    (HERE / "zero_norm.py", "model_bug", "geometry", "SqrtBackward0", ".sqrt()"),
    (ROOT / "sample_models" / "grad_overflow.py", "fp16_grad_overflow", "head", "ToCopyBackward0", "output.float()"),
])
def test_triage_names_the_node_and_its_line(spec: Path, cause: str, module: str, node: str, text: str) -> None:
    report, _ = triage(spec, TriageConfig(steps=2))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step) == (cause, module, 0), v.summary
    assert f"first Inf gradient is made by {node}" in v.summary and _line(spec, text) in v.summary
    ev = report.findings[0].evidence
    assert (ev["grad_node"], ev["grad_line"]) == (node, _line(spec, text))


@pytest.mark.slow
def test_a_replayed_capture_names_the_node_in_the_runs_step(tmp_path: Path) -> None:
    # a real loop's capture (a summed loss whose unscaled gradients leave FP16 at step 30): `triage --from` names the
    # node of the replayed step, at the run's own step number
    from tests.test_skip_judgement import PERSIST_SPEC, _persistent

    _persistent(tmp_path / "cap")
    spec = tmp_path / "spec.py"
    spec.write_text(PERSIST_SPEC)
    report, _ = triage(spec, TriageConfig(), from_capture=tmp_path / "cap")
    v = report.verdict
    assert (v.cause, v.first_step, v.first_module) == ("fp16_grad_overflow", 30, "1"), v.summary
    ev = report.findings[0].evidence
    # the weight gradient of Linear 1 sums 16000 tokens in its matmul: AddmmBackward0 makes the Inf; an nn.Sequential
    # of torch modules has no line of the user's to name
    assert (ev["grad_node"], ev["grad_op"], ev["grad_module"], ev["grad_line"]) == ("AddmmBackward0", "linear", "1", None)
    assert "the first Inf gradient is made by AddmmBackward0, the backward of linear in 1, from finite" in v.summary


def test_a_replay_that_fails_in_backward_is_not_said_to_give_a_non_finite_loss() -> None:
    from ampdoctor.report.words.evidence import evidence

    ev = {"loss": 49.8, "grad_l2": float("nan"), "replay_from_initial_weights_finite": False, "replay_loss": 49.8,
          "grad_node": "SqrtBackward0", "grad_op": "sqrt", "grad_line": "zero_norm.py:17", "grad_module": "geometry",
          "grad_summed": False}
    text = " ".join(evidence(ev))
    assert "gives a finite loss (49.8) but non-finite gradients." in text
    assert "In backward, SqrtBackward0 (sqrt at zero_norm.py:17, in geometry) makes the first non-finite gradient." in text
    nan = {**ev, "replay_loss": float("nan")}
    assert "gives a non-finite loss (nan)." in " ".join(evidence(nan))
