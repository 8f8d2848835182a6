"""``parallel.tp``: a tensor-parallel plan read off the model (styles from their hooks, placements, mesh) and
rebuilt on a fresh one, in one CPU process over gloo (world 1: every layout here is the same as on N ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


def test_a_plan_is_recorded_from_the_model_and_rebuilt_on_a_fresh_one() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "assets" / "tp_layout_worker.py")], capture_output=True,
                       text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    rec = got["recipe"]
    assert rec["plan"] == {
        "up": {"style": "ColwiseParallel", "input_layouts": ["R"], "output_layouts": ["S(-1)"], "use_local_output": True},
        "down": {"style": "RowwiseParallel", "input_layouts": ["S(-1)"], "output_layouts": ["R"], "use_local_output": False}}
    # the hand-placed parameter is recorded by its placement; the LayerNorm no style touched is not a DTensor
    assert rec["placements"] == {"up.weight": ["S(0)"], "up.bias": ["S(0)"], "down.weight": ["S(1)"], "down.bias": ["R"],
                                 "scale": ["R"]}
    assert rec["mesh"] == [1] and rec["unsupported"] == [] and got["fine"] is None
    assert got["again"] == rec  # rebuilt (parallelize_module, then distribute_tensor for `scale`): the same plan
    assert "up.weight: rebuilt, it is placed ['S(0)']; the run placed it ['S(1)']" in got["wrong"]
    assert got["sequence"] == ["SequenceParallel on norm"]
    assert "uses SequenceParallel on norm" in got["refusal"]
    assert got["words"] == "tensor_parallel (ColwiseParallel of up; RowwiseParallel of down on a mesh of (1,))"
