"""Issue 39, item 2: words that fit the cause. A fix chosen by the mechanism (a softmax row masked throughout is the
mask, not a domain error); a cycled dataloader's repeated batch said once; a skip on a non-finite loss never counted
as GradScaler calibration. Each on a tiny real model (tests/words/) and on the scale-history arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampdoctor import TriageConfig, triage
from ampdoctor.judge.scaler import diagnose_scale
from ampdoctor.report.words.fixes import fix_text
from ampdoctor.report.words.scaler import recommendations

HERE = Path(__file__).parent / "words"
SAMPLES = Path(__file__).parent.parent / "sample_models"


@pytest.mark.parametrize(("spec", "module", "rows", "first"), [
    ("masked_row.py", "attn", 5, "(3, 0)"),  # a sequence that is all padding: masked_fill(-inf), torch.softmax
    ("masked_causal.py", "blocks.0.attn", 3, "(1, 0)"),  # left padding under a causal mask: torch.where, F.softmax
])
def test_a_fully_masked_attention_row_is_fixed_at_the_mask(spec: str, module: str, rows: int, first: str) -> None:
    report, _ = triage(HERE / spec, TriageConfig(steps=2))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("model_bug", module, 0, "fp32"), v.summary
    assert f"its softmax gets {rows} row(s) masked throughout (first at index {first})" in v.summary
    fixes = " ".join(report.fixes)
    assert f"Fix the mask in {module}" in fixes and "clamp before log/sqrt" not in fixes


def test_a_domain_error_keeps_its_guard_words() -> None:
    report, _ = triage(SAMPLES / "model_bug.py", TriageConfig(steps=2))
    assert report.verdict.first_module == "log_features" and "masked" not in report.verdict.summary
    assert "clamp before log/sqrt" in report.fixes[0]
    assert fix_text  # the words module is the one the report uses


def test_a_nan_batch_cycled_is_one_batch_and_no_calibration() -> None:
    report, run = triage(HERE / "nan_first_batch.py", TriageConfig(steps=40))
    assert (report.verdict.cause, report.verdict.first_step) == ("data", 0)
    amp = run.results["amp"]
    assert amp.skipped_steps == [0, 8, 16, 24, 32]
    assert all(amp.records[s].skip_reason == "nonfinite_loss" for s in amp.skipped_steps)
    assert report.scaler is not None and report.scaler.calibration_skips == 0
    text = report.scaler.explanation
    assert "Isolated skips on one batch, batch 0, seen at steps 0, 8, 16 ...: check that batch" in text
    assert "calibration" not in text


def test_nonfinite_loss_skips_are_not_calibration_in_the_arithmetic() -> None:
    # GradScaler's defaults: a skip halves the scale. Step 0 skips on a NaN loss; steps 1 and 2 overflow at scales no
    # step has carried yet, taking the scale to new lows: those two are calibration, the NaN one is not.
    scales = [65536.0, 32768.0, 16384.0, 8192.0, 8192.0, 8192.0]
    skipped = [True, True, True, False, False, False]
    plain = diagnose_scale(scales, skipped)
    told = diagnose_scale(scales, skipped, nonfinite=[True] + [False] * 5)
    assert plain.calibration_skips == 3 and plain.later_skips == []
    assert told.calibration_skips == 2 and told.later_skips == [0]
    assert any("init_scale=8192 (2^13) skips the 2 calibration step(s)" in r for r in recommendations(told))
    only_nan = diagnose_scale([65536.0, 32768.0, 32768.0], [True, False, False], nonfinite=[True, False, False])
    assert only_nan.calibration_skips == 0 and not any("calibration" in r for r in recommendations(only_nan))
