"""torchrun / DDP: two CPU processes (gloo); rank 1 gets a batch with an Inf at step 5.

Every rank's log must name rank 1, its module and step 5, say rank 0 was clean, and only rank 1
writes a capture, which ``triage --from`` reads. Runs the sample the docs tell users to run, under
``python -m torch.distributed.run`` (what ``torchrun`` is)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ampdoctor.capture.read import read_capture
from ampdoctor.cli.app import app
from ampdoctor.parallel.exchange import RankExchange, RankView, parse_column, rank_path
from ampdoctor.watch.steplog_read import read_step_log

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


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
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


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
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


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_scaler_reads_several_rank_logs(full_run: Path) -> None:
    r = CliRunner().invoke(app, ["scaler", str(full_run / "steps.rank0.csv"), str(full_run / "steps.rank1.csv")],
                           env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "2 rank logs" in text
    assert "First non-finite: step 5, rank 1 (input in embed); the other ranks were clean" in text
    assert "every rank used the same scale and skipped the same steps" in text
    assert "nonfinite_from_rank:1" in text


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
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


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
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
    host = np.zeros((4, 5))
    host[0] = [8, 0, 0, 1, 0]  # rank 0: parameter gradient only (after the all-reduce)
    host[2] = [2 | 8, 3, 0, 1, 3]  # rank 2: forward in b
    host[3] = [1 | 8, 0, 0, 2, 0]  # rank 3: loss
    view = rx.decode(host.reshape(-1))
    assert view.first is not None and (view.first.rank, view.first.kind, view.first.module) == (2, "forward", "b")
    assert not view.others_clean
    assert view.column() == "0:grad:a;2:forward:b;3:loss:b"
    assert RankView(2, ()).first is None and RankView(2, ()).column() == ""


def test_rank_paths() -> None:
    assert rank_path("out/steps.csv", 3) == str(Path("out/steps.rank3.csv"))
    assert rank_path("out/cap", 1) == str(Path("out/cap.rank1"))


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
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


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
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


def _sharded(mode: str, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER), mode, str(out),
           *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r, [json.loads((out / f"result.rank{k}.json").read_text()) for k in (0, 1)]


def _norms_agree(log: Path, ref: list[float]) -> None:
    """The logged global norm is clip_grad_norm_'s at every step (NaN where it is NaN)."""
    got = read_step_log(log).frame["grad_l2_pre_clip"].astype(float).tolist()
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        assert (math.isnan(g) and math.isnan(r)) or g == pytest.approx(r, rel=1e-5), (got, ref)


def _replay(cap: Path) -> dict[str, object]:
    r = CliRunner().invoke(app, ["triage", str(WORKER), "--from", str(cap), "--json", "-", "-q"])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    out = tmp_path_factory.mktemp("fsdp2")
    _, res = _sharded("fsdp2", out)
    return out, res


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_fsdp2_logs_the_global_norm_and_names_rank1_and_embed(fsdp2_run: tuple[Path, list[dict[str, object]]]) -> None:
    out, res = fsdp2_run
    assert all(x["steps"] == 8 and x["finite"] and x["off"] is None and not x["warnings"] for x in res)
    for rank in (0, 1):
        _norms_agree(out / f"steps.rank{rank}.csv", res[rank]["ref"])  # type: ignore[arg-type]
        f = read_step_log(out / f"steps.rank{rank}.csv").frame.set_index("step")
        assert res[rank]["first_fault"] == [5, 1, "input", "embed"]
        seen = parse_column(str(f.loc[5, "ranks"]))
        assert (1, "input", "embed") in seen and [r for r, k, _ in seen if k != "grad"] == [1]
        assert str(f.loc[5, "nonfinite_params"]).split(";")[:2] == ["embed.weight", "embed.bias"]  # the user's names
        assert bool(f.loc[5, "skipped"]) and f["scaler_scale"].tolist()[-1] == 512.0  # ShardedGradScaler, read
    assert res[0]["clip_diff"] is not None and res[0]["clip_diff"] <= 1e-5  # mon.step(max_norm) clips on the global norm
    assert [x["observe_diff"] for x in res] == [0.0, 0.0]  # watching changed no bit of the weights
    for x in res:  # distributed=False: no exchange, so no global norm to log, and nothing raises
        off, norms = x["alone"]  # type: ignore[misc]
        assert off is None and all(math.isnan(n) for n in norms)


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_fsdp2_capture_reassembles_on_one_process_and_replays_to_data(
        fsdp2_run: tuple[Path, list[dict[str, object]]]) -> None:
    out, _ = fsdp2_run
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("cap")) == ["cap.rank0", "cap.rank1"]
    for rank in (0, 1):  # each rank's own shard, plain tensors: loads with weights_only=True, no engine class in it
        st = torch.load(out / f"cap.rank{rank}" / "state.pt", weights_only=True)
        assert all(type(v) is torch.Tensor for v in st["model"].values())
        assert st["model"]["embed.weight"].shape == (16, 8)  # half of embed's 32 rows
    cap = read_capture(out / "cap.rank1")
    full = torch.load(out / "full.pt", weights_only=True)
    assert set(cap.model) == set(full) and all(torch.equal(cap.model[k], full[k]) for k in full)
    assert cap.model["head.weight"].shape == (1, 6)  # rank 1 held an empty slice of it
    rep = _replay(out / "cap.rank1")
    assert rep["verdict"]["cause"] == "data" and rep["verdict"]["first_step"] == 5  # type: ignore[index]
    assert any("reassembled the whole model from the 2 ranks' shards (fsdp2) of step 5" in n
               for n in rep["notes"])  # type: ignore[attr-defined]
    assert _replay(out / "cap")["verdict"] == rep["verdict"]  # the name given to Monitor(capture=...) reads the same


def _nproc(cap: Path, n: str, spec: Path = WORKER) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(cap), "--nproc", n, "--json", "-", "-q"])
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_fsdp2_capture_replays_on_two_ranks_under_its_layout_to_data(
        fsdp2_run: tuple[Path, list[dict[str, object]]]) -> None:
    out, _ = fsdp2_run
    rec = json.loads((out / "cap.rank0" / "manifest.json").read_text())["shards"]["recipe"]
    assert rec == {"engine": "fsdp2", "fully_shard": ["head", "mid", "embed", ""], "mesh": [2],
                   "mp_policy": {"param_dtype": "float16", "reduce_dtype": "float32", "output_dtype": None,
                                 "cast_forward_inputs": True}}
    code, stdout, _ = _nproc(out / "cap.rank1", "2")
    assert code in (0, 1), stdout
    rep = json.loads(stdout)
    assert rep["verdict"]["cause"] == "data" and rep["verdict"]["first_step"] == 5
    ran = rep["config"]["replayed_on"]
    assert ran["nproc"] == 2 and list(ran["stages"]) == ["fp32", "amp"]
    for st in ran["stages"].values():  # every rank its own shard and batch: rank 1's input, at embed, in FP32 too
        assert st["first_fault"] == [5, 1, "input", "embed", True] and st["off"] is None
        assert [s["step"] for s in st["steps"]] == [5] and st["steps"][0]["skipped"]
    assert rep["notes"][0].startswith("replayed on 2 ranks under fsdp2 (fully_shard of head, mid, embed, the model on a "
                                      "mesh of (2,), MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32))")
    assert not any("on one process" in n and "reassembled" in n for n in rep["notes"][:1])


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_nproc_refuses_a_wrong_count_another_layout_and_a_whole_capture_in_one_line(
        fsdp2_run: tuple[Path, list[dict[str, object]]], full_run: Path,
        fsdp1_run: tuple[Path, str, list[dict[str, object]]], tmp_path: Path) -> None:
    import shutil

    for k in (0, 1):  # a capture whose layout was not recorded (recipe null), and one a replay cannot rebuild
        shutil.copytree(fsdp1_run[0] / f"cap.rank{k}", tmp_path / f"cap.rank{k}")
    for recipe, said in ((None, "records no sharding recipe for its fsdp1 layout"),
                         ({"use_orig_params": False}, "wrapped with use_orig_params=False")):
        for k in (0, 1):
            m = json.loads((fsdp1_run[0] / f"cap.rank{k}" / "manifest.json").read_text())
            m["shards"]["recipe"] = None if recipe is None else {**m["shards"]["recipe"], **recipe}
            (tmp_path / f"cap.rank{k}" / "manifest.json").write_text(json.dumps(m))
        code, _, err = _nproc(tmp_path / "cap.rank1", "2")
        assert code == 2 and said in err and "drop --nproc" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    out, _ = fsdp2_run
    code, _, err = _nproc(out / "cap.rank1", "3")
    assert code == 2 and "--nproc 3" in err and "give --nproc 2" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = _nproc(next(full_run.glob("cap*")), "2", SAMPLE)  # DDP: one process's whole model
    assert code == 2 and "whole model" in err and "drop --nproc" in err
    r = CliRunner().invoke(app, ["triage", str(SAMPLE), "--nproc", "2"])
    assert r.exit_code == 2 and "give --from CAPTURE_DIR" in r.stderr


@pytest.mark.slow
def test_nproc_a_rank_that_cannot_set_up_stops_every_rank_in_one_line(
        fsdp2_run: tuple[Path, list[dict[str, object]]], tmp_path: Path) -> None:
    import shutil

    out, _ = fsdp2_run
    for k in (0, 1):
        shutil.copytree(out / f"cap.rank{k}", tmp_path / f"cap.rank{k}")
    mf = tmp_path / "cap.rank1" / "manifest.json"
    m = json.loads(mf.read_text())
    m["shards"]["model"]["embed.weight"]["offset"] = [0, 0]  # rank 1 claims rank 0's rows: not the layout rebuilt
    mf.write_text(json.dumps(m))
    code, _, err = _nproc(tmp_path / "cap.rank1", "2")  # rank 0 set up fine and must not wait forever
    assert code == 2 and "the replay on 2 ranks failed" in err and "rank 1: CaptureError: embed.weight" in err
    assert "stopped: another rank could not set up" not in err  # the rank that failed, not the one it stopped


@pytest.mark.slow
def test_another_runs_rank_folder_is_refused_on_one_process_and_under_nproc_naming_the_folders(
        fsdp2_run: tuple[Path, list[dict[str, object]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    import tempfile

    out, _ = fsdp2_run
    other = tmp_path / "other"
    other.mkdir()
    _sharded("fsdp2", other)  # a second run of the same model: the same step fails, its own run id
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copytree(out / "cap.rank0", mixed / "cap.rank0")
    shutil.copytree(other / "cap.rank1", mixed / "cap.rank1")
    ids = [json.loads((mixed / f"cap.rank{k}" / "manifest.json").read_text())["run_id"] for k in (0, 1)]
    assert ids[0] != ids[1] and all(isinstance(i, str) for i in ids)
    assert json.loads((other / "cap.rank0" / "manifest.json").read_text())["run_id"] == ids[1]  # one id a run
    for args in ([], ["--nproc", "2"]):
        r = CliRunner().invoke(app, ["triage", str(WORKER), "--from", str(mixed / "cap.rank1"), "-q", *args])
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and "are captures of different runs" in lines[0], r.output
        assert "cap.rank0" in lines[0] and "cap.rank1" in lines[0] and ids[0] in lines[0] and ids[1] in lines[0]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # --nproc's results folder goes when the replay ends
    code, _, _ = _nproc(out / "cap.rank1", "2")
    assert code in (0, 1) and not list(tmp_path.glob("ampdoctor-ranks-*"))


@pytest.mark.slow
def test_fsdp2_bf16_sentinel_mode_logs_the_global_norm_and_names_rank1(tmp_path: Path) -> None:
    _, res = _sharded("fsdp2_bf16", tmp_path, "sentinel")
    assert all(x["off"] is None and x["finite"] for x in res)
    for rank in (0, 1):
        _norms_agree(tmp_path / f"steps.rank{rank}.csv", res[rank]["ref"])  # type: ignore[arg-type]
        assert res[rank]["first_fault"][:2] == [5, 1]  # type: ignore[index]
    assert _replay(tmp_path / "cap.rank1")["verdict"]["cause"] == "data"  # type: ignore[index]


@pytest.fixture(scope="module")
def fsdp1_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[dict[str, object]]]:
    out = tmp_path_factory.mktemp("fsdp1")
    r, res = _sharded("fsdp1", out)
    return out, r.stderr, res


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_fsdp1_logs_the_global_norm_under_the_users_names_and_clips_on_it(
        fsdp1_run: tuple[Path, str, list[dict[str, object]]]) -> None:
    out, stderr, res = fsdp1_run
    assert all(x["steps"] == 8 and x["finite"] and x["off"] is None for x in res)  # finished, nothing aborted
    for rank in (0, 1):
        _norms_agree(out / f"steps.rank{rank}.csv", res[rank]["ref"])  # type: ignore[arg-type]
        assert res[rank]["first_fault"] == [5, 1, "input", "embed"]
        f = read_step_log(out / f"steps.rank{rank}.csv").frame.set_index("step")
        assert "_fsdp_wrapped_module" not in str(f.loc[5, "nonfinite_params"]) + str(f.loc[5, "ranks"])
    assert res[0]["clip_diff"] is not None and res[0]["clip_diff"] <= 1e-5  # == model.clip_grad_norm_(max_norm)
    assert [x["observe_diff"] for x in res] == [0.0, 0.0]  # watching changed no bit of the weights
    assert stderr.count("ampdoctor: step 5 failed: the loss is nan") == 1  # said once, by rank 1
    drift = [w for w in res[0]["drift"] if "drift apart" in w]  # type: ignore[attr-defined]
    assert len(drift) == 1 and "ShardedGradScaler" in drift[0] and not res[1]["drift"]  # plain GradScaler: once, rank 0


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_fsdp1_capture_of_every_rank_replays_to_data(fsdp1_run: tuple[Path, str, list[dict[str, object]]]) -> None:
    out, _, _ = fsdp1_run
    m = json.loads((out / "cap.rank1" / "manifest.json").read_text())
    assert (m["step"], m["rank"], m["first_rank"], m["sharded"]) == (5, 1, 1, "fsdp1")
    assert "flat" in m["shards"]["model"]["embed.weight"]  # a slice of the flattened parameter
    cap = read_capture(out / "cap.rank0")
    full = torch.load(out / "full.pt", weights_only=True)
    assert all(torch.equal(cap.model[k], full[k]) for k in full)
    rep = _replay(out / "cap.rank0")
    assert rep["verdict"]["cause"] == "data" and rep["verdict"]["first_step"] == 5  # type: ignore[index]
    assert "replayed rank 1's batch" in " ".join(rep["notes"])  # type: ignore[arg-type]
    assert m["shards"]["recipe"] == {"engine": "fsdp1", "wrapped": ["head", "mid", "embed", ""], "mesh": [2],
                                     "mixed_precision": {"param_dtype": "float16", "reduce_dtype": "float32", "buffer_dtype": None},
                                     "sharding_strategy": "FULL_SHARD", "use_orig_params": True}


@pytest.mark.slow
def test_fsdp1_capture_replays_on_two_ranks_under_its_wrapping_to_data(
        fsdp1_run: tuple[Path, str, list[dict[str, object]]]) -> None:
    out, _, _ = fsdp1_run
    code, stdout, err = _nproc(out / "cap.rank1", "2")
    assert code == 1, stdout + err
    rep = json.loads(stdout)
    assert rep["notes"][0].startswith("replayed on 2 ranks under fsdp1 (FullyShardedDataParallel of head, mid, embed, the "
                                      "model, FULL_SHARD, use_orig_params=True, MixedPrecision(param_dtype=float16, "
                                      "reduce_dtype=float32))")
    ran = rep["config"]["replayed_on"]
    assert list(ran["stages"]) == ["fp32", "amp"]
    for st in ran["stages"].values():  # every rank its own slice and batch: rank 1's input, read first by embed
        assert st["first_fault"] == [5, 1, "input", "embed", True] and st["off"] is None and st["steps"][0]["skipped"]
    assert _core(rep) == _core(_replay(out / "cap.rank1"))
    assert rep["verdict"]["cause"] == "data" and rep["verdict"]["first_step"] == 5


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    out = tmp_path_factory.mktemp("tp")
    _, res = _sharded("tp", out)
    return out, res


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_tensor_parallel_names_the_rank_whose_own_computation_went_bad_first(
        tp_run: tuple[Path, list[dict[str, object]]]) -> None:
    out, res = tp_run
    assert all(x["steps"] == 8 and x["finite"] and x["off"] is None and not x["warnings"] for x in res)
    for rank in (0, 1):
        _norms_agree(out / f"steps.rank{rank}.csv", res[rank]["ref"])  # type: ignore[arg-type]
        # RowwiseParallel's all-reduce carried rank 1's NaN (embed, its own shard) into rank 0's mid: rank 1 first
        assert res[rank]["first_fault"] == [5, 1, "forward", "embed"]
        seen = parse_column(str(read_step_log(out / f"steps.rank{rank}.csv").frame.set_index("step").loc[5, "ranks"]))
        assert seen == [(0, "forward", "mid"), (1, "forward", "embed")]
    assert [x["observe_diff"] for x in res] == [0.0, 0.0]  # watching changed no bit of the weights
    rep = _replay(out / "cap.rank1")  # the whole model on one process: the NaN was rank 1's computation, not data
    assert rep["verdict"]["cause"] == "not_reproduced" and rep["verdict"]["first_step"] == 5  # type: ignore[index]
    assert any("(tensor_parallel)" in n for n in rep["notes"])  # type: ignore[attr-defined]


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_tensor_parallel_capture_records_its_plan_and_refuses_one_it_cannot_rebuild(
        tp_run: tuple[Path, list[dict[str, object]]], tmp_path: Path) -> None:
    import shutil

    out, _ = tp_run
    for rank in (0, 1):
        m = json.loads((out / f"cap.rank{rank}" / "manifest.json").read_text())
        assert m["shards"]["recipe"] == {
            "engine": "tensor_parallel", "mesh": [2], "unsupported": [],
            "plan": {"embed": {"style": "ColwiseParallel", "input_layouts": ["R"], "output_layouts": ["S(-1)"], "use_local_output": True},
                     "mid": {"style": "RowwiseParallel", "input_layouts": ["S(-1)"], "output_layouts": ["R"], "use_local_output": True},
                     "head": {"style": "RowwiseParallel", "input_layouts": ["R"], "output_layouts": ["R"], "use_local_output": True}},
            "placements": {"embed.weight": ["S(0)"], "embed.bias": ["S(0)"], "mid.weight": ["S(1)"], "mid.bias": ["R"],
                           "head.weight": ["S(1)"], "head.bias": ["R"]}}
        st = torch.load(out / f"cap.rank{rank}" / "state.pt", weights_only=True)  # plain tensors, this rank's pieces
        assert all(type(v) is torch.Tensor for v in st["model"].values()) and st["model"]["embed.weight"].shape == (16, 8)
    for k in (0, 1):
        shutil.copytree(out / f"cap.rank{k}", tmp_path / f"cap.rank{k}")
    for edit, said in ((("unsupported", ["SequenceParallel on mid"]), "uses SequenceParallel on mid"),
                       (("mesh", [1, 2]), "mesh has shape [1, 2]")):
        for k in (0, 1):  # (the check reads rank 0's manifest)
            m = json.loads((out / f"cap.rank{k}" / "manifest.json").read_text())
            m["shards"]["recipe"][edit[0]] = edit[1]
            (tmp_path / f"cap.rank{k}" / "manifest.json").write_text(json.dumps(m))
        code, _, err = _nproc(tmp_path / "cap.rank1", "2")  # refused before any process starts
        assert code == 2 and said in err and "drop --nproc" in err and len(err.strip().splitlines()) == 1, err


def _core(rep: dict[str, Any]) -> tuple[object, ...]:
    v = rep["verdict"]
    return v["cause"], v["first_step"], v["first_module"], v["stage"], rep["config"]["capture_rank"]


@pytest.mark.slow
def test_tensor_parallel_capture_replays_on_two_ranks_under_its_plan(tp_run: tuple[Path, list[dict[str, object]]]) -> None:
    out, _ = tp_run
    code, stdout, err = _nproc(out / "cap.rank1", "2")
    assert code in (0, 1), stdout + err
    rep = json.loads(stdout)
    assert rep["notes"][0].startswith("replayed on 2 ranks under tensor_parallel (ColwiseParallel of embed; RowwiseParallel "
                                      "of mid, head on a mesh of (2,))")
    ran = rep["config"]["replayed_on"]
    assert ran["nproc"] == 2 and list(ran["stages"]) == ["fp32", "amp"]
    for st in ran["stages"].values():  # the NaN was rank 1's own computation at run time, not in the weights or batch
        assert st["first_fault"] is None and st["off"] is None and [s["step"] for s in st["steps"]] == [5]
    assert _core(rep) == _core(_replay(out / "cap.rank1")) == ("not_reproduced", 5, None, "amp", 1)


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_tensor_parallel_replay_names_the_rank_whose_own_shard_overflowed_not_the_lowest(
        tp_run: tuple[Path, list[dict[str, object]]], tmp_path: Path) -> None:
    import shutil

    out, _ = tp_run
    for k in (0, 1):
        shutil.copytree(out / f"cap.rank{k}", tmp_path / f"cap.rank{k}")
    f = tmp_path / "cap.rank1" / "state.pt"
    st = torch.load(f, weights_only=True)
    st["model"]["embed.weight"][0] = 3e4  # rank 1's rows of embed only: finite in FP32, past FP16's 65504 in its output
    torch.save(st, f)
    code, stdout, err = _nproc(tmp_path / "cap.rank1", "2")
    assert code == 1, stdout + err
    rep = json.loads(stdout)
    stages = rep["config"]["replayed_on"]["stages"]
    assert stages["fp32"]["first_fault"] is None
    # mid's all-reduce carried rank 1's overflow into rank 0's mid: by forward position, rank 1 at embed is first
    assert stages["amp"]["first_fault"] == [5, 1, "forward", "embed", True]
    assert "amp: step 5, rank 1's forward, first at embed" in rep["notes"][0]
    assert _core(rep) == _core(_replay(tmp_path / "cap.rank1")) == ("fp16_forward_overflow", 5, "embed", "amp", 1)
    assert "point at" not in rep["notes"][0]  # the ranks' replay and the rules on one process agree


def test_tensor_parallel_order_is_the_forward_position_not_the_rank_number() -> None:
    rx = RankExchange(None, 0, 3, ["<model>", "embed", "mid"], ["embed.weight", "mid.weight"])
    host = np.zeros((3, 5))
    host[0] = [2, 3, 0, 0, 4]  # rank 0: mid's output, late in the forward (the all-reduce brought it)
    host[1] = [2, 3, 0, 0, 4]
    host[2] = [2, 2, 0, 0, 2]  # rank 2: embed's output, its own shard
    view = rx.decode(host.reshape(-1))
    assert view.first is not None and view.first.rank == 0  # DDP's rule: the lowest rank
    rx.by_position = True
    view = rx.decode(host.reshape(-1))
    assert view.first is not None and (view.first.rank, view.first.module) == (2, "embed")
    assert view.spread and view.others_clean
    host[0] = [2, 2, 0, 0, 2]  # two ranks bad at the same place: the lowest, and not one rank's alone
    view = rx.decode(host.reshape(-1))
    assert view.first is not None and view.first.rank == 0 and not view.spread and not view.others_clean


@pytest.mark.slow
def test_a_rank_whose_monitor_fails_takes_every_rank_off_at_that_step_without_a_hang(tmp_path: Path) -> None:
    r, res = _sharded("fail", tmp_path)
    assert all(x["steps"] == 8 and x["finite"] for x in res)
    assert "statistics exploded on rank 1" in str(res[1]["off"]) and "at step 2" in str(res[1]["off"])
    assert "the monitor of rank 1 failed" in str(res[0]["off"]) and "from step 2" in str(res[0]["off"])
    for rank in (0, 1):  # the rows before it are kept; none after
        assert read_step_log(tmp_path / f"steps.rank{rank}.csv").frame["step"].tolist() == [0, 1]
