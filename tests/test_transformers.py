"""A real architecture: GPT-2 from transformers, built from a tiny config (optional extra)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampdoctor.engine.triage import triage
from ampdoctor.input.config import TriageConfig

from .conftest import write_spec

pytest.importorskip("transformers")

SPEC = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

SCALE = {scale}

def build_model():
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                     attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    m = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        m.transformer.h[1].attn.c_attn.weight.mul_(SCALE)  # query/key grow: q @ k^T passes 65504
    return m

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(6):
        ids = torch.randint(0, 100, (4, 16), generator=g)
        out.append({{"input_ids": ids, "labels": ids, "attention_mask": torch.ones(4, 16, dtype=torch.long)}})
    return out
"""


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_gpt2_healthy(tmp_path: Path) -> None:
    report, _ = triage(write_spec(tmp_path, SPEC.format(scale=1.0)), TriageConfig(steps=12))
    assert report.verdict.cause == "healthy", report.verdict.summary


def test_gpt2_attention_logits_overflow(tmp_path: Path) -> None:
    report, _ = triage(write_spec(tmp_path, SPEC.format(scale=1000.0)), TriageConfig(steps=6))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step) == ("fp16_forward_overflow", "transformer.h.1.attn", 0), v.summary
    ev = report.findings[0].evidence
    assert ev["op"] == "matmul" and ev["fp32_absmax"] > 65504
