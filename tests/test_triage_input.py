"""Bad input gets one line, exit 2, no traceback; odd-but-valid specs work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.triage import triage
from ampdoctor.input.config import TriageConfig

from .conftest import SAMPLES, write_spec

GOOD_DATA = """
import torch
def build_dataloader():
    return [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
"""
GOOD_MODEL = """
import torch
def build_model():
    return torch.nn.Linear(3, 1)
def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)
"""

BAD = {
    "missing_model": (GOOD_DATA, "has no function build_model()"),
    "syntax": (GOOD_MODEL + "\ndef broken(:\n", "syntax error"),
    "import": ("import not_a_module_xyz\n" + GOOD_MODEL + GOOD_DATA, "import failed"),
    "wrong_model_type": (GOOD_DATA + "\ndef build_model():\n    return 3\n", "returned int"),
    "empty_loader": (GOOD_MODEL + "\ndef build_dataloader():\n    return []\n", "yielded no batches"),
    "strings": (GOOD_MODEL + "\ndef build_dataloader():\n    return [('a cat', 'a dog')]\n", "holds no tensors"),
    "no_loss": (GOOD_DATA + "\nimport torch\ndef build_model():\n    return torch.nn.Linear(3, 1)\n", "reduce it"),
    "raises": (GOOD_DATA + "\ndef build_model():\n    raise ValueError('no weights here')\n", "build_model() raised ValueError"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_spec_one_line_exit_2(tmp_path: Path, case: str) -> None:
    body, expected = BAD[case]
    spec = write_spec(tmp_path, body)
    res = CliRunner().invoke(app, ["triage", str(spec), "--steps", "2"])
    assert res.exit_code == 2, res.output
    assert expected in res.output
    assert "Traceback" not in res.output
    assert res.output.strip().startswith("error:")


def test_missing_file_and_bad_options(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["triage", str(tmp_path / "nope.py")])
    assert r.exit_code == 2 and "no such file" in r.output
    spec = write_spec(tmp_path, GOOD_MODEL + GOOD_DATA)
    r = CliRunner().invoke(app, ["triage", str(spec), "--target", "fp8"])
    assert r.exit_code == 2 and "--target must be one of" in r.output
    r = CliRunner().invoke(app, ["triage", str(spec), "--steps", "0"])
    assert r.exit_code == 2 and "--steps" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_that_is_not_there(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, GOOD_MODEL + GOOD_DATA)
    r = CliRunner().invoke(app, ["triage", str(spec), "--device", "cuda"])
    assert r.exit_code == 2
    assert "no CUDA device" in r.output and "--device cpu" in r.output


def test_existing_json_is_not_overwritten(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, GOOD_MODEL + GOOD_DATA)
    out = tmp_path / "report.json"
    out.write_text("keep me")
    r = CliRunner().invoke(app, ["triage", str(spec), "--json", str(out), "--steps", "2"])
    assert r.exit_code == 2 and "--force" in r.output
    assert out.read_text() == "keep me"
    r = CliRunner().invoke(app, ["triage", str(spec), "--json", str(out), "--steps", "2", "--force"])
    assert r.exit_code in (0, 1) and out.read_text().startswith("{")


def test_dict_batches_and_model_computed_loss(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, """
import torch
from torch import nn

class Out:
    def __init__(self, loss): self.loss = loss

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)
    def forward(self, input_ids, labels, attention_mask=None):
        logits = self.head(self.emb(input_ids))
        return Out(nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten()))

def build_model():
    return LM()

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 11, (2, 5), generator=g), "labels": torch.randint(0, 11, (2, 5), generator=g),
             "attention_mask": torch.ones(2, 5), "note": "strings pass through"} for _ in range(4)]
""")
    report, run = triage(spec, TriageConfig(steps=10))
    results = run.results
    assert report.verdict.cause == "healthy", report.verdict.summary
    assert any("cycled" in n for n in report.notes)
    # integer inputs are never cast: the raw FP16 stage still ran the embedding
    assert results["fp16"].error is None and len(results["fp16"].records) == 10


def test_stage_error_is_recorded_and_other_stages_run() -> None:
    report, run = triage(SAMPLES / "lstm_cpu.py", TriageConfig(steps=4, device="cpu"))
    results = run.results
    amp = results["amp"]
    assert amp.error is not None and amp.error.module == "encoder"
    assert "oneDNN" in amp.error.hint and "not a NaN cause" in amp.error.hint
    assert len(results["fp32"].records) == 4
    s = {x.name: x for x in report.stages}
    assert s["amp"].error is not None and s["fp32"].error is None


def test_same_initial_weights_and_batches_in_every_stage() -> None:
    report, run = triage(SAMPLES / "healthy.py", TriageConfig(steps=3))
    results = run.results
    l32, l16, lamp = (results[s].records[0].loss for s in ("fp32", "fp16", "amp"))
    # step 0 sees the same weights and batch: losses agree to FP16 precision
    assert abs(l16 - l32) / l32 < 1e-2 and abs(lamp - l32) / l32 < 1e-2


def test_triage_log_is_the_scaler_csv(tmp_path: Path) -> None:
    from ampdoctor.watch.steplog import COLUMNS, read_step_log

    log = tmp_path / "steps.csv"
    r = CliRunner().invoke(app, ["triage", str(SAMPLES / "grad_overflow.py"), "--steps", "6", "--log", str(log), "-q"])
    assert r.exit_code == 1, r.output
    header = log.read_text().splitlines()[0].split(",")
    assert tuple(header[: len(COLUMNS)]) == COLUMNS
    steps = read_step_log(log)
    assert len(steps.frame) == 6
    assert steps.frame["skip_reason"].iloc[0] == "nonfinite_grad:head"
    assert list(steps.frame["scaler_scale"].iloc[:3]) == [65536.0, 32768.0, 16384.0]
    r = CliRunner().invoke(app, ["triage", str(SAMPLES / "grad_overflow.py"), "--steps", "2", "--log", str(log)])
    assert r.exit_code == 2 and "--force" in r.output


def test_outlier_batch_is_data(tmp_path: Path) -> None:
    """Targets x1e8 in one batch (the seed articles' loss-spike injection): finite in FP32, a skip in AMP."""
    spec = write_spec(tmp_path, """
import torch
from torch import nn
def build_model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
def build_dataloader():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(12):
        x = torch.randn(32, 16, generator=g)
        y = x.sum(1, keepdim=True)
        out.append((x, y * 1e8 if i == 9 else y))
    return out
def loss_fn(o, y):
    return nn.functional.mse_loss(o.float(), y)
""")
    report, _ = triage(spec, TriageConfig(steps=20))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("data", None, 9, "amp"), v.summary
    ev = report.findings[0].evidence
    assert ev["field"] == "targets" and ev["ratio_to_median"] > 1e7
