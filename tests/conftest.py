from __future__ import annotations

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
