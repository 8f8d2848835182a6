"""A zoo of real architectures at tiny configs, built from config objects (no downloads).

Each family trains ``healthy`` under AMP, and one injected fault of its own class gives its
verdict and first module. Slow (about 5 minutes of CPU): marked ``zoo``, deselected by default;
CI runs ``python -m pytest -q -m zoo tests/test_zoo.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ampdoctor.engine.triage import triage
from ampdoctor.input.config import TriageConfig

pytest.importorskip("transformers")

pytestmark = pytest.mark.zoo

ZOO = Path(__file__).resolve().parent / "zoo"

FAMILIES = {
    # family: (domain, fault, (cause, first_module, first_step, stage), options)
    "bert": ("text", "attn_overflow", ("fp16_forward_overflow", "bert.encoder.layer.1.attention.self", 0, "amp"), {}),
    "gpt2": ("text", "grad_overflow", ("fp16_grad_overflow", "lm_head", 0, "amp"), {}),
    "llama": ("text", "update_swallowed", ("fp16_update_swallowed", None, 0, "fp16"), {"target": "fp16"}),
    "roberta": ("text", "grad_underflow", ("fp16_grad_underflow", "classifier.out_proj", None, "amp"), {}),
    "vit": ("vision", "data_nan", ("data", None, 2, "fp32"), {}),
    "convnext": ("vision", "loss_bce", ("fp16_forward_overflow", None, 0, "amp"), {}),
    "wav2vec2": ("audio", "custom_fn", ("amp_misuse", "projector", 0, "amp"), {}),
    "whisper": ("audio", "model_bug", ("model_bug", "projector.1", 0, "fp32"), {}),
    "unet": ("diffusion", "amp_misuse", ("amp_misuse", "conv_out", 0, "amp"), {}),  # the hooked layer first reached in backward
}
NEEDS = {"unet": "diffusers"}


def _spec(tmp_path: Path, family: str, fault: str) -> Path:
    pytest.importorskip(NEEDS.get(family, "transformers"))
    shutil.copy(ZOO / "common.py", tmp_path / "common.py")
    text = (ZOO / f"{family}.py").read_text()
    assert 'FAULT = "none"' in text
    p = tmp_path / f"{family}.py"
    p.write_text(text.replace('FAULT = "none"', f'FAULT = "{fault}"'))
    return p


def test_the_zoo_covers_text_vision_audio_diffusion_and_distinct_faults() -> None:
    assert len(FAMILIES) >= 8
    assert {d for d, *_ in FAMILIES.values()} == {"text", "vision", "audio", "diffusion"}
    faults = [f for _, f, *_ in FAMILIES.values()]
    assert len(set(faults)) == len(faults)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_healthy_under_amp(tmp_path: Path, family: str) -> None:
    report, _ = triage(_spec(tmp_path, family, "none"), TriageConfig(steps=6))
    v = report.verdict
    assert (v.cause, v.stage) == ("healthy", "amp"), v.summary
    assert not [f for f in report.findings if f.severity == "error" or f.code.startswith("data_")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_injected_fault(tmp_path: Path, family: str) -> None:
    _, fault, (cause, module, step, stage), opts = FAMILIES[family]
    report, _ = triage(_spec(tmp_path, family, fault), TriageConfig(steps=8, **opts))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == (cause, module, step, stage), v.summary
    assert report.findings[0].code == cause and report.fixes
    assert "<model>" not in v.summary
