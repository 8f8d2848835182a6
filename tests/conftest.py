from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_models"


@pytest.fixture
def samples() -> Path:
    return SAMPLES


def write_spec(tmp_path: Path, body: str, name: str = "spec.py") -> Path:
    p = tmp_path / name
    p.write_text(body)
    return p


# Full statistics on every step while the kernel builds, so that a test's records do not depend on whether a
# background build finished; tests/test_warmup.py checks the cheap warm-up path itself.
os.environ.setdefault("AMPDOCTOR_WARMUP", "full")
