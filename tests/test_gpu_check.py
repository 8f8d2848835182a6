"""``bench/gpu_check.sh --dry``: the GPU script's logic end to end on the CPU (the CUDA tests skip, the table runs
on tiny batches). Slow: under load FP16 on a CPU is emulated (about 20 s of CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_prints_one_table_of_both_models_and_three_variants(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry"], capture_output=True, text=True,
                         env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "dry run on the CPU: no GPU was used" in out
    assert "skipped" in out  # the CUDA tests ran and skipped: no device
    assert (tmp_path / "gpu_check.txt").read_text() == out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["gpt"], ["resnet"])]
    assert [(r[0], r[1]) for r in rows] == [(m, v) for m in ("gpt", "resnet") for v in ("bare", "full", "sentinel")]
    for r in rows:
        assert float(r[2]) > 0 and r[4] == "-"  # a time; no syncs counted on the CPU
        assert float(r[3]) == 1.0 if r[1] == "bare" else float(r[3]) > 0


def test_the_table_layout() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_table import table

    text = table([{"model": "gpt", "variant": "full", "ms": 12.3456, "ratio": 1.0123, "syncs": 2},
                  {"model": "resnet", "variant": "bare", "ms": 3.0, "ratio": 1.0, "syncs": None}], "NVIDIA H100")
    assert text.splitlines() == ["device: NVIDIA H100",
                                 "model    variant     ms/step  x bare  syncs",
                                 "gpt      full          12.35   1.012      2",
                                 "resnet   bare           3.00   1.000      -"]
