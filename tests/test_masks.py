"""Non-finite attention from masking: rows a mask leaves with no key (NaN in every precision: model_bug at the
attention module, the rows named), a mask constant beyond FP16 (-1e9: the forward overflow it is), and a -inf mask
whose NaN the forward hides and the backward does not (its gradients poison the batch)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor import TriageConfig, triage
from ampdoctor.formats import FP16
from ampdoctor.judge.opscan import masked_rows

HERE = Path(__file__).resolve().parent / "masks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _line(name: str, text: str) -> str:
    lines = (HERE / f"{name}.py").read_text().splitlines()
    return f"{name}.py:{next(i for i, s in enumerate(lines, 1) if text in s)}"


def test_multihead_attention_with_an_all_padding_sample_is_a_model_bug_at_the_attention() -> None:
    # nn.MultiheadAttention's default need_weights=True takes a softmax over the key_padding_mask's -inf rows
    report, _ = triage(HERE / "mha_padding.py", TriageConfig(steps=2))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("model_bug", "attn", 0, "fp32"), v.summary
    assert ("its multi_head_attention_forward gets 7 row(s) masked throughout (first at index (2, 0)), in sample(s) 2"
            in v.summary)
    assert report.fixes[0].startswith("Fix the mask in attn")
    assert report.findings[0].evidence["fully_masked_rows"]["samples"] == [2]


def test_a_minus_inf_mask_hidden_by_nan_to_num_is_named_in_backward() -> None:
    # the forward is finite (nan_to_num on the probabilities); softmax's backward is NaN on the rows with no key
    report, _ = triage(HERE / "causal_nan_to_num.py", TriageConfig(steps=2))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step) == ("model_bug", "blocks.1.attn", 0), v.summary
    assert "blocks.1.attn (backward)" in v.summary and "in sample(s) 1" in v.summary
    assert (f"the first NaN gradient is made by SoftmaxBackward0, the backward of softmax at "
            f"{_line('causal_nan_to_num', 'F.softmax(s + bias')} in blocks.1.attn") in v.summary
    fixes = " ".join(report.fixes)
    assert fixes.startswith("Fix the mask in blocks.1.attn") and "clamp before log/sqrt" not in fixes
    assert "leaves the backward NaN" in fixes


def test_a_minus_1e9_mask_in_fp16_is_the_forward_overflow_and_its_fix_is_the_constant() -> None:
    report, _ = triage(HERE / "mask_constant.py", TriageConfig(steps=2))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("fp16_forward_overflow", "encoder.attn", 0, "amp")
    assert "its mul op reaches 1e+09 in FP32" in v.summary
    assert ("softmax gets 12 row(s) masked throughout with a constant beyond FP16's range (every entry at most -1e+09), "
            "first at index (0, 0), in sample(s) 0") in v.summary
    assert report.fixes[0].startswith("Fix the mask constant in encoder.attn: fill with torch.finfo(scores.dtype).min")
    assert report.findings[0].evidence["rows_beyond_fp16"]["rows"] == 12


def test_the_same_mask_filled_with_finfo_min_trains() -> None:
    report, _ = triage(HERE / "mask_finfo.py", TriageConfig(steps=2))
    assert report.verdict.cause == "healthy", report.verdict.summary


def test_sdpa_returns_zero_for_a_row_with_no_key_here_and_its_rows_are_still_seen() -> None:
    # PyTorch's SDPA kernels on this CPU return 0 for a query that may attend to nothing: no NaN, nothing to blame
    report, _ = triage(HERE / "sdpa_padding.py", TriageConfig(steps=2))
    assert report.verdict.cause == "healthy", report.verdict.summary
    m = _load("sdpa_padding")
    model = m.build_model()
    x, keep, _y = m.build_dataloader()[0]
    found = masked_rows(model, "attn", lambda: model(x, keep))
    assert found is not None
    assert (found.op, found.rows, found.first, found.samples) == ("scaled_dot_product_attention", 14, (3, 0, 0), (3,))  # 2 heads x 7


@pytest.mark.parametrize(("row", "beyond_rows", "inf_rows"), [
    ([-1e9, -1e9, -1e9], 1, 0),        # finite in FP32, -inf in FP16
    ([float("-inf")] * 3, 0, 1),       # NaN in every precision: not a constant's fault
    ([-1e9, 0.5, -1e9], 0, 0),         # one key kept
    ([-65504.0, -65504.0, -65504.0], 0, 0),  # FP16's own min: held, finite
])
def test_rows_beyond_fp16_are_told_from_rows_of_minus_inf(row: list[float], beyond_rows: int, inf_rows: int) -> None:
    class Soft(torch.nn.Module):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return torch.softmax(s, dim=-1)

    model = torch.nn.Sequential(Soft())
    s = torch.tensor([[0.1, 0.2, 0.3], row])
    beyond = masked_rows(model, "0", lambda: model(s), FP16.overflow_threshold)
    inf = masked_rows(model, "0", lambda: model(s))
    assert (beyond.rows if beyond else 0, inf.rows if inf else 0) == (beyond_rows, inf_rows)
    if beyond is not None:
        assert beyond.first == (1,) and beyond.value == -1e9


def test_masked_fill_with_minus_1e9_on_fp16_scores_is_the_forward_overflow_not_amp_misuse() -> None:
    # PyTorch refuses the fill ("value cannot be converted to type c10::Half without overflow"): the stage raises, and
    # the constant is what overflows FP16; no row is fully masked here
    report, _ = triage(HERE / "pool_fill.py", TriageConfig(steps=2))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("fp16_forward_overflow", "pool", 0, "amp"), v.summary
    assert "the masked_fill op inside pool writes a value of magnitude 1e+09" in v.summary
    assert report.fixes[0].startswith("Fix the mask constant in pool")
    assert report.findings[0].title == "pool's masked_fill writes a value FP16 cannot hold"
    fp32 = next(s for s in report.stages if s.name == "fp32")
    assert fp32.first_nonfinite_step is None


_VALUES = [float("-inf"), -1e9, -1e5, -65536.0, -65520.0, -65519.0, -65504.0, -3.0, 0.0, 2.5]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_VALUES), min_size=3, max_size=3), min_size=1, max_size=6))
def test_rows_beyond_fp16_are_exactly_the_rows_fp16_holds_as_minus_inf(rows: list[list[float]]) -> None:
    # the definition: a row finite in FP32 whose FP16 cast is -inf throughout (softmax NaN in FP16 only); a row of -inf
    # is NaN in every precision and counted by the plain scan instead
    class Soft(torch.nn.Module):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return torch.softmax(s, dim=-1)

    model = torch.nn.Sequential(Soft())
    s = torch.tensor(rows, dtype=torch.float32)
    want_beyond = sum(bool(torch.isfinite(r).all() and (r.half() == float("-inf")).all()) for r in s)
    want_inf = sum(bool((r == float("-inf")).all()) for r in s)
    beyond = masked_rows(model, "0", lambda: model(s), FP16.overflow_threshold)
    inf = masked_rows(model, "0", lambda: model(s))
    assert (beyond.rows if beyond else 0, inf.rows if inf else 0) == (want_beyond, want_inf)
