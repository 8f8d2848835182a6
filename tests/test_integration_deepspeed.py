"""DeepSpeed ZeRO on the CPU (``DS_ACCELERATOR=cpu``, 2 processes over gloo), watched by
``ampdoctor.integrations.deepspeed.watch``: the norm is DeepSpeed's, a NaN in rank 1's batch at step 5
names rank 1 and ``embed``, a forced FP16 overflow is a skip with the scale halved, each rank's capture
is reassembled on one process and replays to ``data`` at step 5 without DeepSpeed, and the run ends
bit-identical to the same run without the monitor.

Marker ``deepspeed`` (kept out of the default run; CI runs ``pytest -m deepspeed`` where DeepSpeed is
installed). The first run builds DeepSpeed's CPU communication extension (minutes); set
``TORCH_EXTENSIONS_DIR`` to keep it between runs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ampdoctor.capture.read import read_capture
from ampdoctor.capture.reassemble import reassemble
from ampdoctor.parallel.exchange import parse_column
from ampdoctor.watch.steplog_read import read_step_log

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "assets" / "deepspeed_worker.py"

pytestmark = [pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")]


def _env() -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "ampdoctor-ds-extensions"))
    return env


def _torchrun(out: Path, *args: str) -> Path:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           "--out", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT, env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out


RUN = ("--stage", "2", "--prec", "fp16", "--nan-step", "5", "--overflow-step", "8", "--steps", "12")


@pytest.fixture(scope="module")
def fp16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-2, fp16; the loop gives the monitor each batch (``keep_batch``): its capture replays whole steps."""
    return _torchrun(tmp_path_factory.mktemp("ds") / "fp16", *RUN, "--keep-batch")


@pytest.fixture(scope="module")
def fp16_zero1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-1, fp16, the same NaN and overflow steps."""
    return _torchrun(tmp_path_factory.mktemp("ds") / "fp16z1", "--stage", "1", *RUN[2:])


@pytest.fixture(scope="module")
def fp16_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fp16 run in sentinel mode (full_every=4)."""
    return _torchrun(tmp_path_factory.mktemp("ds") / "sentinel", *RUN, "--keep-batch", "--mode", "sentinel")


@pytest.fixture(scope="module")
def fp16_bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _torchrun(tmp_path_factory.mktemp("ds") / "bare", *RUN, "--bare")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-1, bf16, two micro-batches a step (gradient accumulation)."""
    return _torchrun(tmp_path_factory.mktemp("ds") / "bf16", "--stage", "1", "--prec", "bf16", "--nan-step", "5", "--steps", "8",
                     "--gas", "2")


def _log(run: Path, rank: int):  # type: ignore[no-untyped-def]
    return read_step_log(run / f"steps.rank{rank}.csv").frame.set_index("step")


def _ds(run: Path, rank: int) -> list[dict]:
    return json.loads((run / f"ds.rank{rank}.json").read_text())


@pytest.mark.parametrize("which", ["fp16", "fp16_zero1", "bf16"])
def test_norm_skip_and_scale_are_deepspeeds(which: str, request: pytest.FixtureRequest) -> None:
    run: Path = request.getfixturevalue(which)
    for rank in (0, 1):
        f = _log(run, rank)
        rows = _ds(run, rank)
        assert list(f.index) == [r["step"] for r in rows]
        for r in rows:
            got = f.loc[r["step"]]
            assert bool(got["skipped"]) == (not r["applied"]), r
            if r["applied"]:  # the global norm of the unscaled gradients: get_global_grad_norm()'s
                assert r["norm"] > 0
                assert math.isclose(float(got["grad_l2_pre_clip"]), r["norm"], rel_tol=1e-5), (rank, r, got["grad_l2_pre_clip"])
            if which.startswith("fp16"):
                assert float(got["scaler_scale"]) == r["scale_before"]
                assert float(got["scale_after"]) == r["scale_after"]
            else:
                assert math.isnan(float(got["scaler_scale"]))  # bf16: no loss scale
    # every rank logs the same global norm
    a, b = _log(run, 0), _log(run, 1)
    ok = ~a["skipped"].astype(bool)
    assert (a.loc[ok, "grad_l2_pre_clip"] == b.loc[ok, "grad_l2_pre_clip"]).all()


@pytest.mark.parametrize("which", ["fp16", "fp16_zero1", "bf16"])
def test_nan_in_rank1_batch_at_step5_names_rank1_and_embed(which: str, request: pytest.FixtureRequest) -> None:
    run: Path = request.getfixturevalue(which)
    for rank in (0, 1):
        f = _log(run, rank)
        seen = parse_column(str(f.loc[5, "ranks"]))
        assert (1, "input", "embed") in seen
        assert [r for r, kind, _ in seen if kind in ("input", "forward", "loss", "backward")] == [1]
        assert bool(f.loc[5, "skipped"])
        assert all(str(f.loc[s, "ranks"]) in ("", "nan") for s in range(5))  # nothing before step 5
    assert _log(run, 0).loc[5, "skip_reason"] == "nonfinite_from_rank:1"
    assert _log(run, 1).loc[5, "skip_reason"] == "nonfinite_loss"
    # the model's own names: no engine prefix anywhere in the log
    text = (run / "steps.rank1.csv").read_text()
    assert "embed.weight" in text and "module." not in text


@pytest.mark.parametrize("which", ["fp16", "fp16_zero1"])
def test_forced_overflow_is_a_skip_with_the_scale_halved(which: str, request: pytest.FixtureRequest) -> None:
    fp16: Path = request.getfixturevalue(which)
    for rank in (0, 1):
        f = _log(fp16, rank)
        assert bool(f.loc[8, "skipped"])
        assert f.loc[8, "skip_reason"].startswith("nonfinite_grad")
        assert (float(f.loc[8, "scaler_scale"]), float(f.loc[8, "scale_after"])) == (1024.0, 512.0)
        # step 5, the first overflow: DeepSpeed's hysteresis (2) skips it and keeps the scale
        assert (bool(f.loc[5, "skipped"]), float(f.loc[5, "scale_after"])) == (True, 1024.0)
        assert float(f.loc[9, "scaler_scale"]) == 512.0
        assert int(f["skipped"].astype(bool).sum()) == _ds(fp16, rank)[-1]["skipped_steps"] == 2


def test_each_rank_captures_its_pieces_as_plain_tensors(fp16: Path) -> None:
    for rank in (0, 1):
        cap = fp16 / f"cap.rank{rank}"
        m = json.loads((cap / "manifest.json").read_text())
        assert (m["step"], m["rank"], m["world_size"], m["sharded"], m["first_rank"], m["first_module"]) == \
            (5, rank, 2, "deepspeed", 1, "embed")
        assert m["deepspeed"]["zero_stage"] == 2 and m["deepspeed"]["cur_hysteresis"] == 1
        for f in cap.glob("*.pt"):
            torch.load(f, weights_only=True)
            with zipfile.ZipFile(f) as z:
                pkl = b"".join(z.read(n) for n in z.namelist() if n.endswith(".pkl"))
            assert b"deepspeed" not in pkl, f  # no DeepSpeed class pickled
        st = torch.load(cap / "state.pt", weights_only=True)
        total = {n: st["model"][n].numel() for n in m["shards"]["model"]}
        assert sum(total.values()) < sum(math.prod(v["shape"]) for v in m["shards"]["model"].values())  # a piece, not all


def _whole(path: Path):  # type: ignore[no-untyped-def]
    """The capture read and reassembled (by read_capture itself where it reassembles sharded captures)."""
    cap = read_capture(path)
    if getattr(cap, "assembled", None):
        return cap, cap.assembled
    return reassemble(cap)


def test_reassembled_state_is_deepspeeds_whole_state(fp16: Path) -> None:
    whole, words = _whole(fp16 / "cap.rank1")
    assert "reassembled" in words and "2 ranks" in words
    want = torch.load(fp16 / "whole.step5.rank0.pt", weights_only=True)  # DeepSpeed's own gathers, as step 5 began
    opt = whole.start.optimizer
    assert opt is not None
    order = whole.manifest["shards"]["optimizer_params"]
    for i, name in enumerate(order):
        assert torch.equal(whole.model[name], want[name]["fp32"]), name
        assert torch.equal(opt["state"][i]["exp_avg"], want[name]["exp_avg"]), name
        assert torch.equal(opt["state"][i]["exp_avg_sq"], want[name]["exp_avg_sq"]), name
    assert whole.start.scaler is not None and whole.start.scaler["scale"] == 1024.0


@pytest.mark.parametrize("which", ["fp16", "bf16"])
def test_triage_replays_the_capture_without_deepspeed(which: str, request: pytest.FixtureRequest) -> None:
    """fp16: the batches given (``keep_batch``), whole steps replayed; bf16: the model's own inputs, the forward alone."""
    run: Path = request.getfixturevalue(which)
    code = ("import sys; sys.modules['deepspeed'] = None\n"  # import deepspeed now raises ImportError
            "from ampdoctor.cli import main\n"
            f"sys.argv = ['ampdoctor', 'triage', {str(WORKER)!r}, '--from', {str(run / 'cap.rank1')!r}, '--json', '-', '-q']\n"
            "main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["verdict"]["cause"] == "data"
    assert rep["verdict"]["first_step"] == 5
    assert rep["config"]["capture_rank"] == 1
    assert any("reassembled" in n and "2 ranks" in n and "step 5" in n for n in rep["notes"])
    assert any("ran the forward alone" in n for n in rep["notes"]) == (which == "bf16")
    assert rep["config"]["target"] == ("amp" if which == "fp16" else "bf16")


@pytest.mark.parametrize("which", ["fp16", "fp16_sentinel"])
def test_watching_changes_nothing(which: str, fp16_bare: Path, request: pytest.FixtureRequest) -> None:
    """With and without the monitor (full statistics, or sentinel mode), over a NaN step and an overflow step:
    every weight, FP32 master partition, optimizer state tensor, loss scaler field and RNG state ends
    bit-identical."""
    fp16: Path = request.getfixturevalue(which)
    for rank in (0, 1):
        a = torch.load(fp16 / f"final.rank{rank}.pt", weights_only=False)
        b = torch.load(fp16_bare / f"final.rank{rank}.pt", weights_only=False)
        assert a["module"].keys() == b["module"].keys()
        for k in a["module"]:
            assert torch.equal(a["module"][k], b["module"][k]), k
        assert all(torch.equal(x, y) for x, y in zip(a["fp32"], b["fp32"], strict=True))
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert sa.keys() == sb.keys()
        for i in sa:
            for k in sa[i]:
                assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)
        assert a["scaler"] == b["scaler"] and a["scaler"]["cur_scale"] == 512.0
        assert (a["skipped_steps"], a["global_steps"]) == (b["skipped_steps"], b["global_steps"]) == (2, 12)
        assert torch.equal(a["rng"], b["rng"])
        assert _ds(fp16, rank) == _ds(fp16_bare, rank)  # the same losses, norms and scales every step


def test_zero3_turns_the_monitor_off_with_one_warning_and_trains_on(tmp_path: Path) -> None:
    out = _torchrun(tmp_path / "z3", "--stage", "3", "--prec", "bf16", "--steps", "3")
    for rank in (0, 1):
        x = json.loads((out / f"zero3.rank{rank}.json").read_text())
        assert "ZeRO stage 3 is not supported yet" in str(x["off"]) and len(x["losses"]) == 3
        assert all(math.isfinite(v) for v in x["losses"])
        assert not [f for f in x["files"] if not f.startswith("zero3.")]  # watched nothing, wrote nothing
        # one warning, from rank 0 only
        assert [c for c, _ in x["said"]] == (["MonitorOffWarning"] if rank == 0 else [])


def test_sentinel_mode_reduces_p_norms_between_full_steps_and_logs_deepspeeds_norm(fp16_sentinel: Path) -> None:
    """Sentinel mode (full_every=4): a step not recorded all-reduces each parameter's sum of squares and a flag
    (P + 1 numbers), not the model-sized gradient; the logged norm is still DeepSpeed's, and rank 1's NaN at
    step 5 is named."""
    run = fp16_sentinel
    n_params = 4  # embed.weight, embed.bias, head.weight, head.bias
    for rank in (0, 1):
        f = _log(run, rank)
        for r in _ds(run, rank):
            if r["applied"]:
                assert math.isclose(float(f.loc[r["step"], "grad_l2_pre_clip"]), r["norm"], rel_tol=1e-5), (rank, r)
        seen = parse_column(str(f.loc[5, "ranks"]))  # (not recorded: rank 1 is named from its loss)
        assert (1, "loss", "embed") in seen and [r for r, k, _ in seen if k != "grad"] == [1]
        assert bool(f.loc[5, "skipped"]) and not any(bool(f.loc[s, "skipped"]) for s in range(5))
        sizes = json.loads((run / f"watch.rank{rank}.json").read_text())["reduced"]
        small, large = n_params + 1, max(sizes)
        assert sizes.count(small) == 12  # one a step
        # the whole gradient on the recorded steps only: 0, 4 (full_every) and 6..11 (full_after the trip at 5)
        assert large == 8 * 32 + 32 + 32 * 4 + 4 and sizes.count(large) == 8 and len(sizes) == 20
        assert sizes[:4] == [small, large, small, small]


def test_loss_backward_instead_of_engine_backward_is_said_once(tmp_path: Path) -> None:
    run = _torchrun(tmp_path / "direct", "--stage", "1", "--prec", "bf16", "--nan-step", "-1", "--steps", "3",
                    "--direct-backward")
    for rank in (0, 1):
        said = json.loads((run / f"watch.rank{rank}.json").read_text())["said"]
        want = ["engine.step() came without engine.backward(loss)"] if rank == 0 else []
        assert [m.split(": ", 1)[1][:48] for _, m in said] == want, said
        assert len(_ds(run, rank)) == 3
