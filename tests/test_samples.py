"""Every sample model gives its cause, first module and first step — through the library and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.triage import triage
from ampdoctor.input.config import TriageConfig

from .conftest import SAMPLES

EXPECTED = {
    # sample: (cause, first_module, first_step, stage, options)
    "healthy.py": ("healthy", None, None, "amp", {}),
    "data_nan.py": ("data", None, 7, "fp32", {}),
    "model_bug.py": ("model_bug", "log_features", 0, "fp32", {}),
    "forward_overflow.py": ("fp16_forward_overflow", "blocks.1.attn", 0, "amp", {}),
    "grad_overflow.py": ("fp16_grad_overflow", "head", 0, "amp", {}),
    "grad_underflow.py": ("fp16_grad_underflow", "head", None, "amp", {}),
    "update_swallowed.py": ("fp16_update_swallowed", None, 0, "fp16", {"target": "fp16"}),
    "amp_misuse.py": ("amp_misuse", "2", 0, "amp", {}),
    "lstm_cpu.py": ("inconclusive", "encoder", 0, "amp", {"device": "cpu"}),
}


@pytest.mark.parametrize("sample", [pytest.param(s, marks=pytest.mark.slow) if s == "forward_overflow.py" else s for s in sorted(EXPECTED)])
def test_sample_verdict(sample: str) -> None:  # forward_overflow.py: the README sample's run (test_readme_sample); again in CI's -m slow
    cause, module, step, stage, opts = EXPECTED[sample]
    report, _ = triage(SAMPLES / sample, TriageConfig(**opts))  # the default 50 steps, as a user runs it
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == (cause, module, step, stage), v.summary
    assert v.summary
    if cause != "healthy":
        assert report.fixes, "every problem comes with a fix"
        assert report.findings[0].code == cause
    assert {s.name for s in report.stages} >= {"fp32", stage}


def test_every_cause_has_a_sample() -> None:
    from ampdoctor.report.model import CAUSES

    # not_reproduced and replay_mismatch need a capture of a real run: tests/test_capture.py and
    # tests/test_model_settings.py replay them; compile_numerics's sample (sample_models/compile_nan.py) compiles with
    # Inductor: tests/test_compile_rung.py (slow)
    assert {c for c, *_ in EXPECTED.values()} == set(CAUSES) - {"not_reproduced", "replay_mismatch", "compile_numerics"}


def test_cli_json_matches_verdict(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / "forward_overflow.py"), "--steps", "8", "--json", str(out), "--device", "cpu"])
    assert res.exit_code == 1, res.output
    assert "blocks.1.attn" in res.output
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1
    assert data["verdict"]["cause"] == "fp16_forward_overflow"
    assert data["verdict"]["first_module"] == "blocks.1.attn"
    assert data["verdict"]["first_step"] == 0
    assert data["verdict"]["stage"] == "amp"
    assert {s["name"] for s in data["stages"]} == {"fp32", "fp16", "amp"}
    assert data["environment"]["device"] == "cpu"
    assert data["environment"]["torch"]
    # the FP32 re-check and the FP32 magnitude are part of the evidence
    ev = data["findings"][0]["evidence"]
    assert ev["fp32_recheck_finite"] is True
    assert ev["fp32_absmax"] > 65504
    # GradScaler's story is the forward's: the skips that follow a non-finite loss are counted as such, and the
    # story does not claim that the gradients overflow (raw FP16 fails in the forward, at its loss)
    sc = data["scaler"]
    fwd = sum(1 for e in sc["skips"] if e["reason"] == "nonfinite_loss")
    assert 0 < fwd < len(sc["skips"]) and "even unscaled" not in sc["explanation"]
    assert sc["explanation"].startswith(f"{fwd} of the {len(sc['skips'])} skips follow a non-finite loss")
    assert "GradScaler calibrating" in sc["explanation"]  # the others: gradients x scale, while it came down
    # a skip on a non-finite loss is never calibration (issue 39): the calibration skips are the gradient overflows
    assert sc["calibration_skips"] == len(sc["skips"]) - fwd


def test_cli_healthy_exit_zero_and_quiet() -> None:
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / "healthy.py"), "--steps", "6", "-q"])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == "healthy module=None step=None stage=amp"


def test_spec_triage_options_are_defaults_the_cli_overrides() -> None:
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / "update_swallowed.py"), "--steps", "4", "-q"])
    assert "fp16_update_swallowed" in res.output
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / "update_swallowed.py"), "--steps", "4", "-q", "--target", "amp"])
    assert res.output.startswith("healthy"), res.output


def test_bf16_stage_when_asked_says_whether_bf16_fixes_it() -> None:
    report, run = triage(SAMPLES / "forward_overflow.py", TriageConfig(steps=12, stages=("fp32", "fp16", "amp", "bf16")))
    assert report.verdict.cause == "fp16_forward_overflow"
    assert run.results["bf16"].first_nonfinite_step is None
    assert any(f.startswith("bf16 was tried in this run: no non-finite values in 12 steps") for f in report.fixes)
    bf16_report, _ = triage(SAMPLES / "forward_overflow.py", TriageConfig(steps=12, target="bf16"))
    assert bf16_report.verdict.cause == "healthy" and bf16_report.verdict.stage == "bf16"


@pytest.mark.parametrize("steps", [8, pytest.param(20, marks=pytest.mark.slow), pytest.param(100, marks=pytest.mark.slow)])  # CI's -m slow
def test_verdicts_do_not_depend_on_the_step_count(steps: int) -> None:
    for sample in ("healthy.py", "grad_underflow.py", "amp_misuse.py"):
        cause, module, step, stage, opts = EXPECTED[sample]
        report, _ = triage(SAMPLES / sample, TriageConfig(steps=steps, **opts))
        assert (report.verdict.cause, report.verdict.first_module) == (cause, module), (sample, steps, report.verdict.summary)


def test_amp_misuse_scaler_story_does_not_call_the_history_healthy() -> None:
    report, _ = triage(SAMPLES / "amp_misuse.py", TriageConfig(steps=12))
    assert report.scaler is not None and "hidden from GradScaler" in report.scaler.explanation
    assert "healthy" not in report.scaler.explanation
