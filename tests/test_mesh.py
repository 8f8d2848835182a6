"""2-D device meshes on 4 CPU processes (gloo, torchrun): FSDP2 x tensor parallelism (``parallel.fsdp2_tp``) and HSDP
(``parallel.hsdp``), each with fp16 ``MixedPrecisionPolicy`` and ``ShardedGradScaler`` (tests/assets/mesh_worker.py).

The logged norm is the true global one: against the engine's own (every gradient gathered whole) at every step, and
against the model unsharded on one process fed every batch group's batch at once (FP32 phase). The first rank is
named: under FSDP2 x TP rank 3's own part of ``embed``'s output goes NaN (not the lowest rank of its batch group, nor
the lowest rank that went bad), under HSDP rank 2's batch. The per-rank captures reassemble on one process and
replay on 4 under the recorded layout (``triage --from CAP --nproc 4``)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as hs
from typer.testing import CliRunner

from ampdoctor.capture.read import read_capture
from ampdoctor.cli.app import app
from ampdoctor.parallel.exchange import RankExchange, parse_column
from ampdoctor.parallel.fsdp2_tp import ENGINE as FSDP2_TP
from ampdoctor.parallel.fsdp2_tp import counted_at, groups_by
from ampdoctor.parallel.hsdp import ENGINE as HSDP
from ampdoctor.watch.steplog_read import read_step_log

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "assets" / "mesh_worker.py"

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


def _run(mode: str, out: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(WORKER), mode, str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=480, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return [json.loads((out / f"result.rank{k}.json").read_text()) for k in range(4)]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("fsdp2_tp")
    return out, _run("fsdp2_tp", out)


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("hsdp")
    return out, _run("hsdp", out)


def _norms_agree(log: Path, ref: list[float]) -> None:
    got = read_step_log(log).frame["grad_l2_pre_clip"].astype(float).tolist()
    assert len(got) == len(ref) == 8
    for g, r in zip(got, ref, strict=True):
        assert (math.isnan(g) and math.isnan(r)) or g == pytest.approx(r, rel=1e-5), (got, ref)


def _nproc(cap: Path, n: str = "4") -> tuple[int, dict[str, Any], str]:
    r = CliRunner().invoke(app, ["triage", str(WORKER), "--from", str(cap), "--nproc", n, "--json", "-", "-q"])
    return r.exit_code, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}), r.stderr


def _one(cap: Path) -> dict[str, Any]:
    r = CliRunner().invoke(app, ["triage", str(WORKER), "--from", str(cap), "--json", "-", "-q"])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _core(rep: dict[str, Any]) -> tuple[object, ...]:
    v = rep["verdict"]
    return v["cause"], v["first_step"], v["first_module"], v["stage"], rep["config"]["capture_rank"]


# FSDP2 x tensor parallelism -----------------------------------------------------------------------

@pytest.mark.slow  # 4 processes end to end: out of the README command, in CI (-m slow)
def test_fsdp2_tp_logs_the_true_global_norm_and_names_rank3_whose_own_shard_went_bad(
        tp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, res = tp_run
    for rank, x in enumerate(res):
        assert x["engine"] == "fsdp2_tp" and x["off"] is None and not x["warnings"]
        _norms_agree(out / f"steps.rank{rank}.csv", x["ref"])  # the engine's own norm, every step, every rank
        # FP32, clipping at 0.5: the model unsharded on one process, fed both dp groups' batches, clip_grad_norm_
        assert x["norm_phase"][0] <= 1e-5 and x["norm_phase"][1] <= 1e-5
        # rank 3's part of embed went NaN; mid's all-reduce carried it to rank 2 later in the forward; FSDP's
        # reduce-scatter to ranks 0 and 1 in backward: rank 3 first, its batch group's other rank not to blame
        assert x["first_fault"] == [5, 3, "forward", "embed", True]
        f = read_step_log(out / f"steps.rank{rank}.csv").frame.set_index("step")
        assert parse_column(str(f.loc[5, "ranks"])) == [(0, "grad", "embed"), (1, "grad", "embed"),
                                                         (2, "forward", "mid"), (3, "forward", "embed")]
        assert bool(f.loc[5, "skipped"]) and not any(bool(f.loc[s, "skipped"]) for s in range(8) if s != 5)
    assert [x["observe_diff"] for x in res] == [0.0] * 4  # watching changed no bit of the weights


@pytest.mark.slow
def test_fsdp2_tp_capture_records_its_layout_and_reassembles_bit_for_bit(tp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = tp_run
    m = json.loads((out / "cap.rank3" / "manifest.json").read_text())
    assert (m["sharded"], m["first_rank"], m["step"]) == ("fsdp2_tp", 3, 5)
    rec = m["shards"]["recipe"]
    assert {k: rec[k] for k in ("engine", "mesh", "mesh_dim_names", "dp", "tp", "fully_shard", "placements")} == {
        "engine": "fsdp2_tp", "mesh": [2, 2], "mesh_dim_names": ["dp", "tp"], "dp": "dp", "tp": "tp",
        "fully_shard": ["head", "mid", "embed", ""],
        "placements": {"embed.weight": ["S(0)"], "embed.bias": ["S(0)"], "mid.weight": ["S(1)"], "mid.bias": ["R"]}}
    assert [rec["plan"][k]["style"] for k in ("embed", "mid")] == ["ColwiseParallel", "RowwiseParallel"]
    # rank 3 (dp 1, tp 1): the last quarter of embed's rows (tp's half, then FSDP's half of it: _StridedShard)
    assert m["shards"]["model"]["embed.weight"] == {"shape": [32, 8], "offset": [24, 0]}
    st = torch.load(out / "cap.rank3" / "state.pt", weights_only=True)
    assert all(type(v) is torch.Tensor for v in st["model"].values()) and st["model"]["embed.weight"].shape == (8, 8)
    cap = read_capture(out / "cap.rank3")
    full = torch.load(out / "full.pt", weights_only=True)
    assert set(cap.model) == set(full) and all(torch.equal(cap.model[k], full[k]) for k in full)


@pytest.mark.slow
def test_fsdp2_tp_capture_replays_on_four_ranks_under_its_layout(tp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = tp_run
    code, rep, err = _nproc(out / "cap.rank3")
    assert code in (0, 1), err
    assert rep["notes"][0].startswith(
        "replayed on 4 ranks under fsdp2_tp (ColwiseParallel of embed; RowwiseParallel of mid over tp, fully_shard of "
        "head, mid, embed, the model over dp, on a mesh of (2, 2) (dp, tp), MixedPrecisionPolicy(param_dtype=float16, "
        "reduce_dtype=float32))")
    ran = rep["config"]["replayed_on"]
    assert ran["nproc"] == 4 and list(ran["stages"]) == ["fp32", "amp"]
    for st in ran["stages"].values():  # the NaN was rank 3's computation at run time, not in its weights or batch
        assert st["first_fault"] is None and st["off"] is None and [s["step"] for s in st["steps"]] == [5]
    assert _core(rep) == _core(_one(out / "cap.rank3")) == ("not_reproduced", 5, None, "amp", 3)


@pytest.mark.slow
def test_fsdp2_tp_replay_names_the_earliest_rank_of_the_lowest_batch_group_whose_shard_overflowed(tp_run: tuple[Path, list[dict[str, Any]]],
                                                                   tmp_path: Path) -> None:
    out, _ = tp_run
    for k in range(4):
        shutil.copytree(out / f"cap.rank{k}", tmp_path / f"cap.rank{k}")
    f = tmp_path / "cap.rank3" / "state.pt"
    st = torch.load(f, weights_only=True)
    st["model"]["embed.weight"][0] = 3e4  # a row of tp 1's half of embed: finite in FP32, past 65504 in FP16's output
    torch.save(st, f)
    code, rep, err = _nproc(tmp_path / "cap.rank3")
    assert code == 1, err
    stages = rep["config"]["replayed_on"]["stages"]
    assert stages["fp32"]["first_fault"] is None
    # FSDP all-gathers tp 1's half over dp: ranks 1 and 3 (tp 1, each dp group's batch) overflow in embed; ranks 0 and
    # 2 only later, through mid's all-reduce. The lowest batch group's earliest: rank 1 at embed, not rank 0 (the
    # lowest rank) at mid; the other group went bad on its own too (its own batch through the same weights)
    assert stages["amp"]["first_fault"] == [5, 1, "forward", "embed", False]
    assert "amp: step 5, rank 1's forward, first at embed" in rep["notes"][0] and "point at" not in rep["notes"][0]
    assert _core(rep) == _core(_one(tmp_path / "cap.rank3")) == ("fp16_forward_overflow", 5, "embed", "amp", 3)


@pytest.mark.slow
def test_nproc_refuses_a_mesh_it_cannot_rebuild_in_one_line(tp_run: tuple[Path, list[dict[str, Any]]],
                                                            tmp_path: Path) -> None:
    out, _ = tp_run
    for k in range(4):
        shutil.copytree(out / f"cap.rank{k}", tmp_path / f"cap.rank{k}")
    for edit, said in ((("mesh_dim_names", ["a", "b"]), "is not a 2-D (dp, tp) mesh"),
                       (("unsupported", ["SequenceParallel on norm"]), "uses SequenceParallel on norm")):
        for k in range(4):
            m = json.loads((out / f"cap.rank{k}" / "manifest.json").read_text())
            m["shards"]["recipe"][edit[0]] = edit[1]
            (tmp_path / f"cap.rank{k}" / "manifest.json").write_text(json.dumps(m))
        code, _, err = _nproc(tmp_path / "cap.rank3")  # refused before any process starts
        assert code == 2 and said in err and "drop --nproc" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _nproc(out / "cap.rank3", "2")
    assert code == 2 and "give --nproc 4" in err and "Traceback" not in err


# HSDP -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_hsdp_logs_the_true_global_norm_and_names_rank2_and_its_batch(hsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, res = hsdp_run
    for rank, x in enumerate(res):
        assert x["engine"] == "hsdp" and x["off"] is None and not x["warnings"]
        _norms_agree(out / f"steps.rank{rank}.csv", x["ref"])
        assert x["norm_phase"][0] <= 1e-5 and x["norm_phase"][1] <= 1e-5  # unsharded, fed the 4 ranks' batches
        assert x["first_fault"] == [5, 2, "input", "embed", True]  # rank 2, in the other replica group than rank 0
        seen = parse_column(str(read_step_log(out / f"steps.rank{rank}.csv").frame.set_index("step").loc[5, "ranks"]))
        assert (2, "input", "embed") in seen and [r for r, k, _ in seen if k != "grad"] == [2]
    assert [x["observe_diff"] for x in res] == [0.0] * 4


@pytest.mark.slow
def test_hsdp_capture_reassembles_and_replays_on_four_ranks_to_data(hsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = hsdp_run
    m = json.loads((out / "cap.rank2" / "manifest.json").read_text())
    assert m["shards"]["recipe"] == {"engine": "hsdp", "mesh": [2, 2], "mesh_dim_names": ["replicate", "shard"],
                                     "fully_shard": ["head", "mid", "embed", ""], "mp_policy": {
                                         "param_dtype": "float16", "reduce_dtype": "float32", "output_dtype": None,
                                         "cast_forward_inputs": True}}
    assert m["shards"]["model"]["embed.weight"] == {"shape": [32, 8], "offset": [0, 0]}  # rank 2: replica 1, shard 0
    full = torch.load(out / "full.pt", weights_only=True)
    cap = read_capture(out / "cap.rank2")
    assert all(torch.equal(cap.model[k], full[k]) for k in full)
    code, rep, err = _nproc(out / "cap.rank2")
    assert code == 1, err
    for st in rep["config"]["replayed_on"]["stages"].values():
        assert st["first_fault"] == [5, 2, "input", "embed", True]
    assert rep["notes"][0].startswith("replayed on 4 ranks under hsdp (fully_shard of head, mid, embed, the model, on a "
                                      "mesh of (2, 2) (replicate, shard)")
    assert _core(rep) == _core(_one(out / "cap.rank2")) == ("data", 5, None, "fp32", 2)


# the exchange's batch groups, without processes --------------------------------------------------

def test_batch_groups_are_the_dp_coordinate_whatever_the_order_of_the_dimensions() -> None:
    ids = SimpleNamespace(mesh=torch.arange(4).reshape(2, 2))
    assert groups_by(ids, [0]) == [0, 0, 1, 1]  # (dp, tp): ranks 0, 1 one batch
    assert groups_by(ids, [1]) == [0, 1, 0, 1]  # (tp, dp)
    assert groups_by(SimpleNamespace(mesh=torch.arange(8).reshape(2, 2, 2)), [0, 1]) == [0, 0, 1, 1, 2, 2, 3, 3]


def _view(rows: dict[int, list[float]], groups: list[int]) -> Any:
    rx = RankExchange(None, 0, 4, ["<model>", "embed", "mid"], ["embed.weight", "mid.weight"])
    rx.groups = groups
    host = np.zeros((4, 5))
    for r, row in rows.items():
        host[r] = row
    return rx.decode(host.reshape(-1))


def test_the_first_rank_is_the_earliest_in_the_forward_of_the_lowest_group_that_saw_it() -> None:
    # FSDP2 x TP, groups (0, 0, 1, 1): rank 3's forward at position 2 in embed, rank 2's later in mid (the all-reduce),
    # ranks 0 and 1 only their parameter gradients (FSDP's reduce-scatter)
    view = _view({0: [8, 0, 0, 1, 0], 1: [8, 0, 0, 1, 0], 2: [2 | 8, 3, 0, 1, 7], 3: [2 | 8, 2, 0, 1, 2]}, [0, 0, 1, 1])
    assert view.first is not None and (view.first.rank, view.first.kind, view.first.module) == (3, "forward", "embed")
    assert view.others_clean  # rank 2 went bad later, through the collective; the other group did not at all
    # the other batch group went bad on its own too: the lowest group is named, and the others were not clean
    view = _view({1: [2 | 8, 3, 0, 1, 9], 2: [2 | 8, 3, 0, 1, 7], 3: [2 | 8, 2, 0, 1, 2]}, [0, 0, 1, 1])
    assert view.first is not None and view.first.rank == 1 and not view.others_clean
    # without groups, the position decides over the whole world (pure tensor parallelism) as before
    view = _view({1: [2 | 8, 3, 0, 1, 9], 3: [2 | 8, 2, 0, 1, 2]}, None)  # type: ignore[arg-type]
    assert view.first is not None and view.first.rank == 1  # not by_position: the lowest rank


@given(hs.lists(hs.integers(1, 3), min_size=1, max_size=3).flatmap(
    lambda shape: hs.tuples(hs.just(shape), hs.sets(hs.integers(0, len(shape) - 1)))))
def test_each_piece_counts_on_exactly_one_of_the_ranks_holding_it(case: tuple[list[int], set[int]]) -> None:
    """Over every rank of a mesh, the ranks whose pieces count are exactly one per distinct piece (the coordinates on
    the sharded dimensions), whichever dimensions shard it: so each element of the whole gradient counts once."""
    shape, sharded = case
    names = [f"d{i}" for i in range(len(shape))]
    coords = torch.cartesian_prod(*[torch.arange(n) for n in shape]).reshape(-1, len(shape)).tolist()
    counted = [c for c in coords if counted_at(c, names, {names[d] for d in sharded})]
    assert sorted(tuple(c[d] for d in sorted(sharded)) for c in counted) == sorted(
        {tuple(c[d] for d in sorted(sharded)) for c in coords})


def test_a_recipe_either_engine_cannot_rebuild_is_refused_in_words() -> None:
    good = {"engine": "fsdp2_tp", "mesh": [2, 2], "mesh_dim_names": ["dp", "tp"], "dp": "dp", "tp": "tp",
            "fully_shard": [""], "plan": {}, "placements": {"embed.weight": ["S(0)"]}, "unsupported": []}
    assert FSDP2_TP.refusal(good) is None
    assert "is not a 2-D (dp, tp) mesh" in str(FSDP2_TP.refusal({**good, "mesh": [4]}))
    assert "records no fully_shard module" in str(FSDP2_TP.refusal({**good, "fully_shard": []}))
    assert "placed P" in str(FSDP2_TP.refusal({**good, "placements": {"embed.weight": ["P"]}}))
    assert HSDP.refusal({"engine": "hsdp", "mesh": [2, 2], "fully_shard": [""]}) is None
    assert "2-D (replicate, shard)" in str(HSDP.refusal({"engine": "hsdp", "mesh": [4], "fully_shard": [""]}))
