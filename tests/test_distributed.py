"""torchrun / DDP: two CPU processes (gloo); rank 1 gets a batch with an Inf at step 5.

Every rank's log must name rank 1, its module and step 5, say rank 0 was clean, and only rank 1
writes a capture, which ``triage --from`` reads. Runs the sample the docs tell users to run, under
``python -m torch.distributed.run`` (what ``torchrun`` is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.ranks import RankExchange, RankView, parse_column, rank_path
from ampdoctor.watch.steplog import read_step_log

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_models" / "ddp_bad_batch.py"

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


def _torchrun(out: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SAMPLE),
           "--out", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp") / "run"
    _torchrun(out)
    return out


def test_both_logs_name_rank1_its_module_and_step5(full_run: Path) -> None:
    assert sorted(p.name for p in full_run.iterdir()) == ["cap.rank1", "steps.rank0.csv", "steps.rank1.csv"]
    for rank in (0, 1):
        f = read_step_log(full_run / f"steps.rank{rank}.csv").frame
        assert (f["rank"].astype(int) == rank).all()
        bad = f[f["ranks"].fillna("").astype(str) != ""]
        assert bad["step"].tolist() == [5]  # no rank saw anything before or after
        seen = parse_column(str(bad["ranks"].iloc[0]))
        assert (1, "input", "embed") in seen  # rank 1: its batch, first read by embed
        assert [r for r, kind, _ in seen if kind != "grad"] == [1]  # rank 0 saw it only through the all-reduce
        assert bool(bad["skipped"].iloc[0])
    r0 = read_step_log(full_run / "steps.rank0.csv").frame.set_index("step")
    r1 = read_step_log(full_run / "steps.rank1.csv").frame.set_index("step")
    assert r0.loc[5, "skip_reason"] == "nonfinite_from_rank:1"  # clean here
    assert r1.loc[5, "skip_reason"] == "nonfinite_loss"
    assert np.isfinite(r0.loc[5, "loss"]) and not np.isfinite(r1.loc[5, "loss"])
    # one loss scale: both ranks skipped step 5 and backed off together
    assert r0["scaler_scale"].tolist() == r1["scaler_scale"].tolist()
    assert r0["skipped"].tolist() == r1["skipped"].tolist()


def test_only_rank1_captures_and_triage_reads_it(full_run: Path) -> None:
    cap = full_run / "cap.rank1"
    m = json.loads((cap / "manifest.json").read_text())
    assert (m["step"], m["rank"], m["world_size"], m["first_rank"], m["first_module"], m["others_clean"]) == \
        (5, 1, 2, 1, "embed", True)
    r = CliRunner().invoke(app, ["triage", str(SAMPLE), "--from", str(cap), "--json", "-", "-q"])
    assert r.exit_code == 1, r.output
    rep = json.loads(r.stdout)
    assert rep["verdict"]["cause"] == "data"
    assert rep["verdict"]["first_step"] == 5
    assert rep["config"]["capture_rank"] == 1


def test_scaler_reads_several_rank_logs(full_run: Path) -> None:
    r = CliRunner().invoke(app, ["scaler", str(full_run / "steps.rank0.csv"), str(full_run / "steps.rank1.csv")],
                           env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "2 rank logs" in text
    assert "First non-finite: step 5, rank 1 (input in embed); the other ranks were clean" in text
    assert "every rank used the same scale and skipped the same steps" in text
    assert "nonfinite_from_rank:1" in text


def test_scaler_says_when_ranks_disagree(full_run: Path, tmp_path: Path) -> None:
    lines = (full_run / "steps.rank1.csv").read_text().splitlines()
    head = lines[0].split(",")
    i = head.index("skipped")
    row = lines[1 + 8].split(",")  # step 8: pretend rank 1 skipped it alone
    row[i] = "1"
    lines[1 + 8] = ",".join(row)
    f = tmp_path / "steps.rank1.csv"
    f.write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(app, ["scaler", str(full_run / "steps.rank0.csv"), str(f)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "ranks 0 and 1 disagree from step 8: rank 0 applied" in " ".join(r.output.split())


def test_sentinel_mode_names_the_rank_from_its_loss(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _torchrun(out, "--mode", "sentinel", "--capture-ranks", "all")  # full statistics every 4th step: not step 5
    f = read_step_log(out / "steps.rank0.csv").frame
    seen = parse_column(str(f.set_index("step").loc[5, "ranks"]))
    assert [(r, k) for r, k, _ in seen] == [(0, "grad"), (1, "loss")]
    # capture_ranks="all": every rank writes its own capture of step 5, each naming rank 1 as the first
    for rank in (0, 1):
        m = json.loads((out / f"cap.rank{rank}" / "manifest.json").read_text())
        assert (m["step"], m["rank"], m["first_rank"]) == (5, rank, 1)


# the exchange without processes -------------------------------------------------------------------

def test_decode_blames_the_lowest_local_rank() -> None:
    rx = RankExchange(None, 0, 4, ["<model>", "a", "b"], ["a.weight", "b.weight"])
    host = np.zeros((4, 4))
    host[0] = [8, 0, 0, 1]  # rank 0: parameter gradient only (after the all-reduce)
    host[2] = [2 | 8, 3, 0, 1]  # rank 2: forward in b
    host[3] = [1 | 8, 0, 0, 2]  # rank 3: loss
    view = rx.decode(host.reshape(-1))
    assert view.first is not None and (view.first.rank, view.first.kind, view.first.module) == (2, "forward", "b")
    assert not view.others_clean
    assert view.column() == "0:grad:a;2:forward:b;3:loss:b"
    assert RankView(2, ()).first is None and RankView(2, ()).column() == ""


def test_rank_paths() -> None:
    assert rank_path("out/steps.csv", 3) == str(Path("out/steps.rank3.csv"))
    assert rank_path("out/cap", 1) == str(Path("out/cap.rank1"))


def test_trainer_under_torchrun_names_the_rank_with_the_bad_sample(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "assets" / "trainer_ddp.py"), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    firsts = set()
    for rank in (0, 1):
        f = read_step_log(out / f"steps.rank{rank}.csv").frame
        assert f["step"].tolist() == list(range(1, 13))  # one row per Trainer optimizer step, numbered as the Trainer does
        bad = f[f["ranks"].fillna("").astype(str) != ""]
        step = int(bad["step"].iloc[0])
        seen = parse_column(str(bad["ranks"].iloc[0]))
        local = [(r_, kind, mod) for r_, kind, mod in seen if kind != "grad"]
        assert len(local) == 1 and local[0][1:] == ("input", "embed")  # one rank's batch, read first by embed
        firsts.add((step, local[0][0]))
    assert len(firsts) == 1  # both ranks' logs name the same rank and step
    (step, rank), = firsts
    caps = sorted(p.name for p in out.iterdir() if p.name.startswith("cap"))
    assert caps == [f"cap.rank{rank}"]
    m = json.loads((out / f"cap.rank{rank}" / "manifest.json").read_text())
    assert (m["step"], m["first_rank"], m["others_clean"], m["precision"]) == (step, rank, True, "bf16")


def test_a_monitor_on_rank0_alone_does_not_hang(tmp_path: Path) -> None:
    import os

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "assets" / "ddp_rank0_only.py"), str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "AMPDOCTOR_RANK_TIMEOUT": "3"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "not every rank built a Monitor within 3 s" in (tmp_path / "warning.txt").read_text()
    log = read_step_log(tmp_path / "steps.csv").frame  # one process's log: no rank suffix, no ranks column
    assert log["step"].tolist() == [0, 1, 2] and "ranks" not in log.columns


# do no harm under torchrun: sharded engines, a rank whose monitor fails ---------------------------

WORKER = ROOT / "tests" / "assets" / "sharded_worker.py"


def _sharded(mode: str, out: Path) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER), mode, str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r, [json.loads((out / f"result.rank{k}.json").read_text()) for k in (0, 1)]


@pytest.mark.slow
def test_fsdp1_capture_on_the_bad_rank_alone_needs_no_collective(tmp_path: Path) -> None:
    r, res = _sharded("fsdp1", tmp_path)
    assert all(x["steps"] == 8 and x["finite"] and x["off"] is None for x in res)  # finished, nothing aborted
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("cap")) == ["cap.rank1"]  # the bad rank's
    m = json.loads((tmp_path / "cap.rank1" / "manifest.json").read_text())
    assert (m["step"], m["rank"], m["first_rank"], m["sharded"]) == (3, 1, 1, "fsdp1")
    assert r.stderr.count("ampdoctor: step 3 failed: the loss is nan") == 1  # said once, by rank 1
    for rank in (0, 1):  # per-shard norms would mislead: the log leaves them out
        f = read_step_log(tmp_path / f"steps.rank{rank}.csv").frame
        assert f["grad_l2_pre_clip"].isna().all() and bool(f.set_index("step").loc[3, "skipped"])


@pytest.mark.slow
def test_fsdp2_turns_the_monitor_off_with_one_warning_and_trains_on(tmp_path: Path) -> None:
    r, res = _sharded("fsdp2", tmp_path)
    assert all(x["steps"] == 8 and x["finite"] and "FSDP2" in str(x["off"]) for x in res)
    said = [w for x in res for w in x["warnings"]]  # type: ignore[attr-defined]
    assert len(said) == 1 and said[0].startswith("MonitorOffWarning: ampdoctor: FSDP2 (fully_shard) is not supported yet")
    assert res[0]["warnings"] == said  # once, from rank 0
    assert not (tmp_path / "steps.rank0.csv").exists() and not (tmp_path / "steps.csv").exists()  # nothing misleading


@pytest.mark.slow
def test_a_rank_whose_monitor_fails_takes_every_rank_off_at_that_step_without_a_hang(tmp_path: Path) -> None:
    r, res = _sharded("fail", tmp_path)
    assert all(x["steps"] == 8 and x["finite"] for x in res)
    assert "statistics exploded on rank 1" in str(res[1]["off"]) and "at step 2" in str(res[1]["off"])
    assert "the monitor of rank 1 failed" in str(res[0]["off"]) and "from step 2" in str(res[0]["off"])
    for rank in (0, 1):  # the rows before it are kept; none after
        assert read_step_log(tmp_path / f"steps.rank{rank}.csv").frame["step"].tolist() == [0, 1]
