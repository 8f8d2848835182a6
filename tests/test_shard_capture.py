"""Per-rank captures of a sharded step, reassembled on one process (``capture.reassemble``), on hand-made
folders: no engine needed. The DeepSpeed end-to-end run is tests/test_integration_deepspeed.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.capture.read import read_capture
from ampdoctor.capture.reassemble import reassemble
from ampdoctor.errors import CaptureError, UsageError
from ampdoctor.parallel.pieces import assemble

W = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
B = torch.tensor([0.5, -1.0, 2.0])


def _write(folder: Path, rank: int, pieces: dict[str, torch.Tensor], layout: dict, step: int = 5) -> None:
    folder.mkdir(parents=True)
    opt = {"state": {i: {"step": torch.tensor(3.0), "exp_avg": t * 2} for i, t in enumerate(pieces.values())},
           "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    torch.save({"model": pieces, "optimizer": opt, "scaler": None}, folder / "state.pt")
    torch.save([(torch.ones(2, 4), torch.zeros(2, 3))], folder / "batches.pt")
    m = {"schema_version": 1, "step": step, "batch_steps": [step], "files": ["batches.pt", "manifest.json", "state.pt"],
         "rank": rank, "world_size": 2, "sharded": "deepspeed", "skipped": True, "reason": "nonfinite_loss",
         "shards": {"model": layout, "optimizer_params": list(pieces)}}
    (folder / "manifest.json").write_text(json.dumps(m))


def _pair(tmp_path: Path, hole: bool = False, step1: int = 5) -> Path:
    flat = W.reshape(-1)
    _write(tmp_path / "cap.rank0", 0, {"weight": flat[:7].clone(), "bias": torch.zeros(0)},
           {"weight": {"shape": [3, 4], "flat": 0}, "bias": {"shape": [3], "flat": 0}})
    _write(tmp_path / "cap.rank1", 1, {"weight": flat[7 + int(hole):].clone(), "bias": B.clone()},
           {"weight": {"shape": [3, 4], "flat": 7 + int(hole)}, "bias": {"shape": [3], "flat": 0}}, step=step1)
    return tmp_path


def test_the_pieces_make_the_whole_model_and_optimizer_state(tmp_path: Path) -> None:
    _pair(tmp_path)
    whole, words = reassemble(read_capture(tmp_path / "cap.rank1"))
    assert torch.equal(whole.model["weight"], W) and torch.equal(whole.model["bias"], B)
    opt = whole.start.optimizer
    assert opt is not None
    assert torch.equal(opt["state"][0]["exp_avg"], W * 2) and torch.equal(opt["state"][1]["exp_avg"], B * 2)
    assert float(opt["state"][0]["step"]) == 3.0
    assert "from the 2 ranks' shards (deepspeed) of step 5 on one process" in words and "rank 1's" in words
    nn.Linear(4, 3).load_state_dict(whole.model)  # loads into the model whole


def test_a_missing_rank_a_hole_or_another_step_is_one_line(tmp_path: Path) -> None:
    _pair(tmp_path / "a")
    import shutil

    shutil.rmtree(tmp_path / "a" / "cap.rank0")
    with pytest.raises(CaptureError, match=r"rank 0's capture cap\.rank0 is not beside it"):
        reassemble(read_capture(tmp_path / "a" / "cap.rank1"))
    _pair(tmp_path / "b", hole=True)
    with pytest.raises(CaptureError, match="1 of 12 elements are in no rank's piece"):
        reassemble(read_capture(tmp_path / "b" / "cap.rank0"))
    _pair(tmp_path / "c", step1=6)
    with pytest.raises(CaptureError, match="not rank 1's capture of the same deepspeed step 5"):
        reassemble(read_capture(tmp_path / "c" / "cap.rank0"))


def test_assemble_blocks_and_flat_slices() -> None:
    full = torch.arange(6.0).reshape(2, 3)
    got = assemble([(full[:1], {"shape": [2, 3], "offset": [0, 0]}), (full[1:], {"shape": [2, 3], "offset": [1, 0]})], "x")
    assert torch.equal(got, full)
    got = assemble([(full.reshape(-1)[:4], {"shape": [2, 3], "flat": 0}), (full.reshape(-1)[4:], {"shape": [2, 3], "flat": 4})], "x")
    assert torch.equal(got, full)


def test_watch_takes_a_deepspeed_engine_and_imports_no_deepspeed() -> None:
    before = "deepspeed" in sys.modules
    from ampdoctor.integrations.deepspeed import watch

    with pytest.raises(UsageError, match="DeepSpeedEngine"):
        watch(nn.Linear(2, 2))
    assert ("deepspeed" in sys.modules) == before


def test_triage_of_a_rank_without_its_siblings_is_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ampdoctor.cli.app import app

    _pair(tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "cap.rank0")
    r = CliRunner().invoke(app, ["triage", "--from", str(tmp_path / "cap.rank1")])
    assert r.exit_code == 2, r.output
    assert "rank 0's capture cap.rank0 is not beside it" in r.output and "Traceback" not in r.output


def test_watch_turns_off_on_zero3_with_one_warning_and_touches_nothing() -> None:
    import warnings

    from ampdoctor.engine.monitor import MonitorOffWarning
    from ampdoctor.integrations.deepspeed import watch

    class DeepSpeedEngine(nn.Module):  # the engine's shape as far as watch reads it before it turns off
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.calls: list[str] = []

        def zero_optimization_stage(self) -> int:
            return 3

        def backward(self, loss: torch.Tensor) -> None:
            self.calls.append("backward")

        def step(self) -> None:
            self.calls.append("step")

    eng = DeepSpeedEngine()
    before = {k: v.clone() for k, v in eng.module.state_dict().items()}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mon = watch(eng, log=None)
        eng.backward(torch.tensor(1.0))
        eng.step()
        mon.close()
    off = [w for w in said if issubclass(w.category, MonitorOffWarning)]
    assert len(off) == 1 and "ZeRO stage 3 is not supported yet" in str(off[0].message)
    assert [w for w in said if "ampdoctor" in str(w.message)] == off  # nothing else said
    assert mon.off is not None and "backward" not in eng.__dict__ and eng.calls == ["backward", "step"]
    assert all(torch.equal(v, before[k]) for k, v in eng.module.state_dict().items())


def test_nproc_on_a_deepspeed_capture_is_one_line_with_or_without_deepspeed(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from ampdoctor.cli.app import app
    from ampdoctor.engine import shard_replay

    _pair(tmp_path)
    spec = tmp_path / "spec.py"
    spec.write_text("from torch import nn\n\ndef build_model():\n    return nn.Linear(4, 3)\n")
    args = ["triage", str(spec), "--from", str(tmp_path / "cap.rank1"), "--nproc", "2"]
    monkeypatch.setattr(shard_replay, "_installed", lambda m: m != "deepspeed")
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "DeepSpeed is not installed here; drop --nproc" in r.stderr, r.output
    monkeypatch.setattr(shard_replay, "_installed", lambda m: True)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "records no sharding recipe for its deepspeed layout" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
