"""The hostile suite for captures (issue 43), beside tests/test_hostile.py: sharded captures whose manifests claim
sizes their pieces do not hold, two runs' shards mixed, a second job's numbered folders, spec-free captures whose
recorded model is not what the weights hold, a budget that left the batches out. Every case is one line naming the
tensor, the folder and the field, exit 2, no traceback; nothing is allocated past what the files hold (checked
under an address-space cap, ``RLIMIT_AS``, in a subprocess).

The folders are written by hand in the format ``capture.reassemble`` documents (no engine needed); the run
identity a real Monitor writes is checked on a real run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor.capture.read import read_capture
from ampdoctor.capture.reassemble import reassemble
from ampdoctor.cli.app import app
from ampdoctor.errors import CaptureError

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
W = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
B = torch.tensor([0.5, -1.0, 2.0])


def _rank(folder: Path, rank: int, pieces: dict[str, torch.Tensor], layout: dict[str, Any], run: str | None = "run-a",
          step: int = 5, optimizer: bool = True) -> None:
    folder.mkdir(parents=True)
    opt = None if not optimizer else {"state": {i: {"step": torch.tensor(3.0), "exp_avg": t * 2} for i, t in enumerate(pieces.values())},
           "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    torch.save({"model": pieces, "optimizer": opt, "scaler": None}, folder / "state.pt")
    torch.save([(torch.ones(2, 4), torch.zeros(2, 3))], folder / "batches.pt")
    m = {"schema_version": 1, "step": step, "batch_steps": [step], "files": ["batches.pt", "manifest.json", "state.pt"],
         "rank": rank, "world_size": 2, "sharded": "fsdp2", "skipped": True, "reason": "nonfinite_loss",
         "run_id": run, "model_fingerprint": "f" * 16,
         "shards": {"model": layout, "optimizer_params": list(pieces)}}
    (folder / "manifest.json").write_text(json.dumps(m))


def _pair(where: Path, run: str | None = "run-a", scale: float = 1.0, names: tuple[str, str] = ("cap.rank0", "cap.rank1"),
          optimizer: bool = True) -> Path:
    """Rank 0 holds rows 0-1 of weight, rank 1 row 2 and the whole bias (a replica on both)."""
    w = W * scale
    _rank(where / names[0], 0, {"weight": w[:2].clone(), "bias": B.clone()},
          {"weight": {"shape": [3, 4], "offset": [0, 0]}, "bias": {"shape": [3], "offset": [0]}}, run, optimizer=optimizer)
    _rank(where / names[1], 1, {"weight": w[2:].clone(), "bias": B.clone()},
          {"weight": {"shape": [3, 4], "offset": [2, 0]}, "bias": {"shape": [3], "offset": [0]}}, run, optimizer=optimizer)
    return where


def _edit(folder: Path, change: Any) -> None:
    mf = folder / "manifest.json"
    m = json.loads(mf.read_text())
    change(m)
    mf.write_text(json.dumps(m))


def _triage(cap: Path, *extra: str) -> tuple[int, str]:
    r = runner.invoke(app, ["triage", "--from", str(cap), "-q", *extra])
    return r.exit_code, r.output


def _one_line(code: int, out: str, *words: str) -> None:
    lines = [x for x in out.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in out, out
    assert all(w in lines[0] for w in words), out


# 1. every size a manifest claims is checked before it is used ---------------------------------------------------

def test_the_pieces_still_make_the_model(tmp_path: Path) -> None:
    whole = read_capture(_pair(tmp_path) / "cap.rank1")
    assert torch.equal(whole.model["weight"], W) and torch.equal(whole.model["bias"], B)


def _huge(m: dict[str, Any]) -> None:  # 48 GB of float32, on every rank (the ranks agree on it)
    m["shards"]["model"]["weight"]["shape"] = [300_000, 40_000]


CAPPED = """
import resource, sys
from pathlib import Path
pages = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
cap = pages + (1 << 30)  # what the process maps now, and 1 GB: far below what the manifest claims
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from ampdoctor.cli.app import main
sys.argv = ["ampdoctor", *sys.argv[1:]]
main()
"""


def _capped(*args: str) -> subprocess.CompletedProcess[str]:
    """``ampdoctor ARGS`` in a process that cannot map 1 GB more than it holds after its imports."""
    pre = "import torch, ampdoctor.cli.app, ampdoctor.engine.triage\n"
    return subprocess.run([sys.executable, "-c", pre + CAPPED, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_a_huge_claimed_shape_is_refused_under_a_memory_cap_before_anything_is_allocated(tmp_path: Path) -> None:
    _pair(tmp_path)
    for k in (0, 1):
        _edit(tmp_path / f"cap.rank{k}", _huge)
    r = _capped("triage", "--from", str(tmp_path / "cap.rank1"), "-q")
    _one_line(r.returncode, r.stderr, "weight", "field shards.model['weight'].shape [300000, 40000]",
              "claims 12000000000 elements", "pieces hold 12", "cap.rank0/manifest.json", "cap.rank1/manifest.json")
    assert "MemoryError" not in r.stderr and "allocate" not in r.stderr


def test_a_shape_the_machine_cannot_hold_is_refused_with_what_it_takes_and_what_is_free(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.input import limits

    _pair(tmp_path)
    monkeypatch.setattr(limits, "free_memory", lambda: 40)  # 12 elements of 4 bytes and a 1-byte mask: 60 bytes
    with pytest.raises(CaptureError, match=r"weight: its shape \[3, 4\] takes 60 B to reassemble, more than the 40 B "
                                           "this machine has free"):
        read_capture(tmp_path / "cap.rank0")


@pytest.mark.parametrize("case, words", [
    ("offset past the shape", ("weight", "cap.rank1/manifest.json field shards.model['weight'].offset is [5, 0]",
                               "runs past the shape [3, 4] in dimension 0 (5 + 1 > 3)")),
    ("shape altered on one rank", ("weight", "cap.rank1/manifest.json field shards.model['weight'].shape is [4, 4]",
                                   "cap.rank0/manifest.json's is [3, 4]")),
    ("piece altered in state.pt", ("weight", "cap.rank1/manifest.json field shards.model['weight'].offset is [2, 0]",
                                   "piece of shape [3, 4] runs past the shape [3, 4] in dimension 0 (2 + 3 > 3)")),
    ("offset of another rank", ("weight", "4 of 12 elements are in no rank's piece", "shards.model['weight']")),
    ("flat past the end", ("bias", "cap.rank1/manifest.json field shards.model['bias'].flat is 2")),
    ("piece missing from state.pt", ("weight: cap.rank1's state file has no piece of it",
                                     "field shards.model names it")),
])
def test_a_damaged_sharded_capture_names_the_tensor_the_file_and_the_field(tmp_path: Path, case: str,
                                                                             words: tuple[str, ...]) -> None:
    _pair(tmp_path)
    r1 = tmp_path / "cap.rank1"
    if case == "offset past the shape":
        _edit(r1, lambda m: m["shards"]["model"]["weight"].update(offset=[5, 0]))
    elif case == "shape altered on one rank":
        _edit(r1, lambda m: m["shards"]["model"]["weight"].update(shape=[4, 4]))
    elif case == "piece altered in state.pt":
        st = torch.load(r1 / "state.pt", weights_only=True)
        st["model"]["weight"] = torch.zeros(3, 4)
        torch.save(st, r1 / "state.pt")
    elif case == "piece missing from state.pt":
        st = torch.load(r1 / "state.pt", weights_only=True)
        del st["model"]["weight"]
        torch.save(st, r1 / "state.pt")
    elif case == "offset of another rank":
        _edit(r1, lambda m: m["shards"]["model"]["weight"].update(offset=[1, 0]))
    else:
        _edit(r1, lambda m: m["shards"]["model"].update(bias={"shape": [3], "flat": 2}))
    code, out = _triage(r1)
    _one_line(code, out, *words)


def test_nproc_checks_every_piece_before_any_process_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.engine import shard_replay

    _pair(tmp_path)
    for k in (0, 1):
        _edit(tmp_path / f"cap.rank{k}", lambda m: m["shards"].update(recipe={"engine": "fsdp2", "mesh": [2],
                                                                              "fully_shard": [""], "mp_policy": None}))
    _edit(tmp_path / "cap.rank1", lambda m: m["shards"]["model"]["weight"].update(offset=[5, 0]))
    started: list[int] = []
    monkeypatch.setattr("torch.multiprocessing.start_processes", lambda *a, **k: started.append(1))
    with pytest.raises(CaptureError, match=r"weight: cap\.rank1/manifest\.json field shards\.model\['weight'\]\.offset "
                                           r"is \[5, 0\]"):
        shard_replay.check(tmp_path / "cap.rank1", 2)
    assert not started


# 2. a run's identity --------------------------------------------------------------------------------------------

def test_two_runs_shards_are_refused_naming_both_folders(tmp_path: Path) -> None:
    _pair(tmp_path / "a", run="run-a")
    _pair(tmp_path / "b", run="run-b", scale=3.0)
    shutil.rmtree(tmp_path / "a" / "cap.rank1")
    shutil.copytree(tmp_path / "b" / "cap.rank1", tmp_path / "a" / "cap.rank1")  # rank 1 of another run of the model
    for named in ("cap.rank0", "cap.rank1"):
        code, out = _triage(tmp_path / "a" / named)
        _one_line(code, out, "are captures of different runs (run id", "run-a", "run-b", "cap.rank0", "cap.rank1")
    from ampdoctor.capture.rank_folders import group_of
    from ampdoctor.capture.reassemble import check_pieces

    with pytest.raises(CaptureError, match="different runs"):  # --nproc's check, before any process starts
        check_pieces(tmp_path / "a" / "cap.rank0", group_of(tmp_path / "a" / "cap.rank0"))


def test_a_second_writers_numbered_folders_keep_their_ranks_together(tmp_path: Path) -> None:
    _pair(tmp_path, run="run-a")
    _pair(tmp_path, run="run-b", scale=3.0, names=("cap.rank0-1", "cap.rank1-1"))  # the second job's names
    for named in ("cap.rank0-1", "cap.rank1-1"):
        whole = read_capture(tmp_path / named)
        assert torch.equal(whole.model["weight"], W * 3.0) and whole.manifest["run_id"] == "run-b"
    assert torch.equal(read_capture(tmp_path / "cap.rank1").model["weight"], W)
    # a race gave the second job's rank 1 the plain name and the first job's the numbered one: grouped by run
    (tmp_path / "cap.rank1").rename(tmp_path / "tmp")
    (tmp_path / "cap.rank1-1").rename(tmp_path / "cap.rank1")
    (tmp_path / "tmp").rename(tmp_path / "cap.rank1-1")
    assert torch.equal(read_capture(tmp_path / "cap.rank0-1").model["weight"], W * 3.0)
    assert torch.equal(read_capture(tmp_path / "cap.rank0").model["weight"], W)
    whole, words = reassemble(read_capture(tmp_path / "cap.rank0-1"))
    assert torch.equal(whole.model["weight"], W * 3.0) and "of step 5" in words


def test_a_second_writers_numbered_folders_replay(tmp_path: Path) -> None:
    spec = tmp_path / "spec.py"
    spec.write_text("from torch import nn\n\ndef build_model():\n    return nn.Linear(4, 3)\n\n"
                    "def loss_fn(out, y):\n    return ((out - y) ** 2).mean()\n")
    _pair(tmp_path, run="run-a", optimizer=False)
    _pair(tmp_path, run="run-b", scale=3.0, names=("cap.rank0-1", "cap.rank1-1"), optimizer=False)
    r = runner.invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap.rank0-1"), "--json", "-", "-q"])
    assert r.exit_code in (0, 1), r.output
    rep = json.loads(r.stdout)
    assert any("reassembled the whole model from the 2 ranks' shards (fsdp2) of step 5" in n for n in rep["notes"])


def _train_with_capture(folder: Path) -> Path:
    torch.manual_seed(0)
    from ampdoctor.engine.monitor import Monitor

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, log=None, quiet=True, capture=folder / "cap")
    for step in range(4):
        x = torch.randn(2, 4) if step != 2 else torch.full((2, 4), float("nan"))
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.after_backward(loss, batch=(x,))
        if not mon.should_skip:
            opt.step()
        mon.after_step()
        opt.zero_grad()
    mon.close()
    written = mon.capture.written if mon.capture is not None else None
    assert written is not None
    return written


def test_a_monitor_writes_its_run_id_and_model_fingerprint(tmp_path: Path) -> None:
    m = json.loads((_train_with_capture(tmp_path) / "manifest.json").read_text())
    assert isinstance(m["run_id"], str) and len(m["run_id"]) == 16
    assert isinstance(m["model_fingerprint"], str) and len(m["model_fingerprint"]) == 16
    m2 = json.loads((_train_with_capture(tmp_path / "again") / "manifest.json").read_text())
    assert m2["run_id"] != m["run_id"] and m2["model_fingerprint"] == m["model_fingerprint"]  # another run, same model


def _ranks_agree(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from ampdoctor.capture.identity import run_id

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    Path(out, f"id{rank}").write_text(str(run_id()))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_ranks_of_one_run_agree_on_its_id_without_a_collective(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ranks_agree, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    ids = [(tmp_path / f"id{r}").read_text() for r in (0, 1)]
    assert ids[0] == ids[1] and len(ids[0]) == 16


# the rebuilt model is checked before it is built --------------------------------------------------------------

def _whole_capture(folder: Path, model: nn.Module, identity: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": None, "scaler": None}, folder / "state.pt")
    torch.save([(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long))], folder / "batches.pt")
    m = {"schema_version": 1, "step": 3, "batch_steps": [3], "files": ["batches.pt", "manifest.json", "state.pt"],
         "rank": 0, "world_size": 1, "sharded": None, "skipped": True, "reason": "nonfinite_loss",
         "model_identity": identity}
    (folder / "manifest.json").write_text(json.dumps(m))
    return folder


def test_the_recorded_model_is_counted_on_the_meta_device_against_the_weights() -> None:
    transformers = pytest.importorskip("transformers")
    from ampdoctor.capture.state import model_identity
    from ampdoctor.errors import SpecError
    from ampdoctor.input import rebuild

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16,
                                                                 n_positions=8))
    held = sum(t.numel() for t in model.state_dict().values())
    ident = model_identity(model)
    rebuild.check_size(rebuild.from_identity(ident, "cap"), held, "cap")  # the run's own config: built as recorded
    ident["transformers_config"].update(n_embd=16384, n_layer=48, vocab_size=50257)
    with pytest.raises(SpecError, match=rf"that model has [\d,]+ parameters, and the capture's weights hold {held:,}"):
        rebuild.check_size(rebuild.from_identity(ident, "cap"), held, "cap")


@pytest.mark.slow
def test_a_recorded_config_edited_to_a_huge_model_is_refused_before_it_is_built(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from ampdoctor.capture.state import model_identity

    cfg = transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg)
    ident = model_identity(model)
    ident["transformers_config"].update(n_embd=16384, n_layer=48, vocab_size=50257)  # 65 GB of float32
    cap = _whole_capture(tmp_path / "cap", model, ident)
    r = _capped("triage", "--from", str(cap), "-q")
    held = sum(t.numel() for t in model.state_dict().values())
    _one_line(r.returncode, r.stderr, "GPT2LMHeadModel", "parameters, and the capture's weights hold",
              f"{held:,} numbers", "refusing to build it")
    assert "MemoryError" not in r.stderr


def test_a_spec_free_capture_of_a_sequential_says_its_layers_were_not_recorded(tmp_path: Path) -> None:
    from ampdoctor.capture.state import model_identity

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    cap = _whole_capture(tmp_path / "cap", model, model_identity(model))
    code, out = _triage(cap)
    _one_line(code, out, "torch.nn.Sequential", "not the layers put into it", "build_model()")
    assert "no trainable parameters" not in out


# 7. the budget left the batches out ---------------------------------------------------------------------------

def test_a_capture_whose_budget_left_out_the_batches_says_so_and_by_how_much(tmp_path: Path) -> None:
    torch.manual_seed(0)
    from ampdoctor.engine.monitor import Monitor

    model = nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, log=None, quiet=True, capture=tmp_path / "cap", capture_max_bytes=1024)
    for step in range(3):
        x = torch.randn(16, 64) if step != 2 else torch.full((16, 64), float("nan"))
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.after_backward(loss, batch=(x,))
        if not mon.should_skip:
            opt.step()
        mon.after_step()
        opt.zero_grad()
    mon.close()
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert m["batch_steps"] == [] and any("batches (capture_max_bytes=1024" in x for x in m["left_out"]), m["left_out"]
    spec = tmp_path / "spec.py"
    spec.write_text("from torch import nn\n\ndef build_model():\n    return nn.Linear(64, 1)\n")
    r = runner.invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "-q"])
    _one_line(r.exit_code, r.output, "the capture budget left out 1 of 1 batches (capture_max_bytes=1024",
              "the failing step's batch takes 4096 bytes", "capture_max_bytes")
    assert "pass batch=" not in r.output
