"""Issue 12's sample models: faults inside the loss, never <model>, frozen layers, backward
exceptions, the data scan. Each asserts verdict, module and step through the library."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampdoctor.engine.triage import triage
from ampdoctor.input.config import TriageConfig

from .conftest import SAMPLES, write_spec

EXPECTED = {
    # sample: (cause, first_module, first_step, stage, options)
    "loss_fault.py": ("fp16_forward_overflow", None, 0, "amp", {}),
    "model_loss.py": ("fp16_forward_overflow", None, 0, "amp", {}),
    "variance_head.py": ("fp16_grad_overflow", "var_head", 0, "amp", {}),
    "custom_function.py": ("amp_misuse", "proj", 0, "amp", {}),
    "frozen_branch.py": ("fp16_grad_underflow", "blocks.1.fc2", None, "fp16", {"target": "fp16"}),
    "data_quirks.py": ("healthy", None, None, "amp", {}),
}


@pytest.mark.parametrize("sample", sorted(EXPECTED))
def test_sample_verdict(sample: str) -> None:
    cause, module, step, stage, opts = EXPECTED[sample]
    report, _ = triage(SAMPLES / sample, TriageConfig(steps=12, **opts))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == (cause, module, step, stage), v.summary
    assert "<model>" not in v.summary
    if cause != "healthy":
        assert report.findings[0].code == cause and report.fixes


@pytest.mark.parametrize("sample", ["loss_fault.py", "model_loss.py"])
def test_the_op_inside_the_loss_is_named_with_the_fix_that_works(sample: str) -> None:
    report, _ = triage(SAMPLES / sample, TriageConfig(steps=4))
    ev = report.findings[0].evidence
    assert ev["op"] == "log" and str(ev["op_line"]).startswith(f"{sample}:")
    assert ev["fp32_recheck_finite"] is True
    assert "binary_cross_entropy_with_logits" in report.fixes[0] and ".float()" in report.fixes[0]
    assert "the forward pass is finite" not in report.verdict.summary.lower()


def test_custom_function_fix_is_custom_fwd_and_custom_bwd() -> None:
    report, _ = triage(SAMPLES / "custom_function.py", TriageConfig(steps=4))
    fix = report.fixes[0]
    assert "ScaledMatmul" in fix and "custom_fwd(device_type='cpu', cast_inputs=torch.float32)" in fix and "custom_bwd" in fix
    assert report.findings[0].evidence["function"] == "ScaledMatmul"


def test_frozen_evidence_lists_flushed_share_and_weight_movement() -> None:
    report, run = triage(SAMPLES / "frozen_branch.py", TriageConfig(steps=12, target="fp16"))
    ev = report.findings[0].evidence
    assert ev["flushed"]["blocks.1.fc2.weight"] == 1.0
    assert ev["weight_movement_vs_fp32"]["blocks.1.fc2.weight"] == 0.0
    assert "head.weight" not in ev["flushed"]  # the trunk trains
    assert run.results["fp16"].moved["head.weight"] > 0.5 * run.results["fp32"].moved["head.weight"]


def test_frozen_also_when_fp32_loss_barely_moves(tmp_path: Path) -> None:
    # the trunk (stem, head) barely trains, so FP32's loss moves under 1% and no stall can be measured;
    # the branches still move in FP32
    body = (SAMPLES / "frozen_branch.py").read_text().replace(
        "return torch.optim.SGD(params, lr=0.05, momentum=0.9)",
        "params = list(params)\n    trunk = params[:2] + params[-2:]\n"
        "    return torch.optim.SGD([{'params': trunk, 'lr': 1e-7}, {'params': params[2:-2]}], lr=0.05, momentum=0.9)")
    assert "trunk" in body
    report, _ = triage(write_spec(tmp_path, body), TriageConfig(steps=12, target="fp16"))
    assert report.config.get("target_progress_vs_fp32") is None  # no stall can be measured
    v = report.verdict
    assert (v.cause, v.first_module) == ("fp16_grad_underflow", "blocks.1.fc2"), v.summary


def test_data_scan_reports_every_kind_even_when_amp_trains() -> None:
    report, _ = triage(SAMPLES / "data_quirks.py", TriageConfig(steps=8))
    assert report.verdict.cause == "healthy"
    by = {f.code: f for f in report.findings}
    s = by["data_sentinel"]
    assert s.evidence["field"] == "depth" and s.evidence["value"] == -999999.0 and len(s.evidence["batches"]) == 8
    o = by["data_outlier"]
    assert (o.step, o.evidence["field"], o.evidence["samples"]) == (3, "x", [7])
    assert o.evidence["value"] > 1e3 * o.evidence["typical_magnitude"]
    assert by["data_beyond_fp16"].step == 5 and by["data_beyond_fp16"].evidence["samples"] == [2]
    p = by["probe_follows_data"]
    assert p.step == 3 and p.evidence["kinds"] == ["outlier"] and "follows the data" in p.title


ROOT_OP = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.enc(x)
        h = torch.exp(h * 20)  # the root's own code: exp passes 65504 in FP16, not in FP32
        return self.head(h / h.sum(-1, keepdim=True).float())

def build_model():
    torch.manual_seed(0)
    return Net()

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(4)]

def loss_fn(out, t):
    return (out.float() - t).pow(2).mean()
"""


def test_root_code_names_the_op_and_its_line_not_the_model(tmp_path: Path) -> None:
    report, _ = triage(write_spec(tmp_path, ROOT_OP), TriageConfig(steps=4))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step) == ("fp16_forward_overflow", None, 0), v.summary
    ev = report.findings[0].evidence
    assert ev["op"] == "exp" and ev["op_line"] == "spec.py:13" and ev["op_in"] == "model's forward"
    assert "`exp` at spec.py:13" in v.summary
