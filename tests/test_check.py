"""``ampdoctor check``: damaged checkpoints found by definition, the first damaged and the last good of a series,
safe reading (a pickle that needs code is refused in one line), exit codes and JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.formats import BF16, FP16
from ampdoctor.input.checkpoint import read_checkpoint
from ampdoctor.judge.checkpoint_health import MOMENT_SLACK, judge, moment_bound

runner = CliRunner()


def cli(*args: str) -> Any:
    return runner.invoke(app, ["check", *args], env={"COLUMNS": "80"})


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(x)))


def run_series(folder: Path, nan_at: int | None, steps: int = 30, every: int = 10) -> None:
    """A plain fp32 loop with AdamW that saves {'model', 'optimizer', 'scaler', 'step'} every ``every`` steps; a NaN in
    the batch of step ``nan_at`` (applied: no GradScaler skips it) poisons every weight from there on."""
    torch.manual_seed(0)
    m = Mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")  # untouched: its default state is saved, as a run on a GPU saves it
    folder.mkdir(parents=True, exist_ok=True)
    for step in range(1, steps + 1):
        x = torch.randn(16, 4)
        if step == nan_at:
            x[3, 1] = float("nan")
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % every == 0:
            torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(), "step": step},
                       folder / f"ckpt_step{step}.pt")


def flat(text: str) -> str:
    return " ".join(text.split())


def test_series_names_first_damaged_and_last_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_series(Path("run"), nan_at=17)
    r = cli("run/ckpt_step30.pt", "run/ckpt_step10.pt", "run/ckpt_step20.pt")  # sorted by the step each one records
    assert r.exit_code == 1, r.output
    assert max(len(line.rstrip()) for line in r.output.splitlines()) <= 80
    out = flat(r.output)
    assert out.endswith("first damaged: run/ckpt_step20.pt (step 20); last good: run/ckpt_step10.pt: resume from it")
    assert out.index("run/ckpt_step10.pt 10 good") < out.index("run/ckpt_step20.pt 20 damaged") < out.index("run/ckpt_step30.pt 30 damaged")
    # what is wrong, by module: both modules' weights and Adam moments
    detail = out.split("run/ckpt_step20.pt: damaged")[1]
    assert "fc1: - weight: NaN/Inf in the values (32 of 32), Adam exp_avg (32 of 32), Adam exp_avg_sq (32 of 32)" in detail
    assert "head: - weight:" in detail


def test_healthy_series_exits_0_and_json(tmp_path: Path) -> None:
    run_series(tmp_path / "run", nan_at=None)
    r = cli(str(tmp_path / "run"), "--json", str(tmp_path / "out.json"))
    assert r.exit_code == 0, r.output
    assert "all 3 checkpoints are healthy" in r.output
    d = json.loads((tmp_path / "out.json").read_text())
    assert d["exit_code"] == 0 and d["first_damaged"] is None
    assert [c["step"] for c in d["checkpoints"]] == [10, 20, 30]
    assert all(c["status"] == "good" and c["scale"] == 65536.0 for c in d["checkpoints"])


def test_json_to_stdout_is_json_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_series(tmp_path / "run", nan_at=25)
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["check", "run", "--json", "-"], env={"COLUMNS": "80"})
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert d["first_damaged"] == "run/ckpt_step30.pt" and d["last_good"] == "run/ckpt_step20.pt"
    bad = d["checkpoints"][2]
    assert {i["module"] for i in bad["issues"]} == {"fc1", "head"}
    assert {i["part"] for i in bad["issues"]} == {"weight", "exp_avg", "exp_avg_sq"}


class Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch PWNED",))


def test_malicious_pickle_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"model": Mlp().state_dict(), "evil": Payload()}, "evil.pt")
    r = cli("evil.pt")
    assert r.exit_code == 2
    assert not (tmp_path / "PWNED").exists()
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in r.output
    assert err.startswith("error: evil.pt: holds pickled Python objects that weights-only loading refuses (posix.system")


def test_unreadable_one_in_a_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_series(Path("run"), nan_at=None)
    Path("run/ckpt_step30.pt").write_bytes(Path("run/ckpt_step30.pt").read_bytes()[:200])  # an interrupted save
    r = cli("run")
    assert r.exit_code == 2, r.output
    out = flat(r.output)
    assert "run/ckpt_step30.pt 30 unreadable truncated or corrupt" in out
    assert out.endswith("no damage found in the 2 checkpoint(s) read; 1 could not be read")


def test_missing_path_and_bad_target(tmp_path: Path) -> None:
    r = cli(str(tmp_path / "nope"))
    assert r.exit_code == 2 and "no such file or folder" in r.stderr
    run_series(tmp_path, nan_at=None, steps=10)
    r = cli(str(tmp_path), "--target", "fp12")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1


# ---------------------------------------------------------------------------------------------- the rules


def test_weights_beyond_fp16_but_within_bf16(tmp_path: Path) -> None:
    m = Mlp()
    with torch.no_grad():
        m.head.weight[0, 0] = 7.0e4  # beyond FP16's 65504 (the cast overflows from 65520)
        m.fc1.bias[0] = 65519.0  # rounds to 65504: within
    state = read_checkpoint(_save(tmp_path, {"model": m.state_dict()}))
    h = judge(state, FP16)
    assert [(i.code, i.name, i.count, i.value) for i in h.issues] == [("out_of_range", "head.weight", 1, 7.0e4)]
    assert not judge(state, BF16).damaged


def _save(tmp_path: Path, obj: Any, name: str = "c.pt") -> Path:
    torch.save(obj, tmp_path / name)
    return tmp_path / name


def test_fp16_adam_state_flushes_v(tmp_path: Path) -> None:
    """Pure FP16 training (a second model unlike the first: a conv net in half precision): Adam keeps its moments in
    FP16, and v = (1-b2) g^2 below 2^-24 flushes to 0 while m = (1-b1) g does not."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv1d(2, 4, 3), nn.Flatten(), nn.Linear(8, 1)).half()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)  # noqa: AMP005 (the damage this test makes on purpose)
    x = torch.randn(4, 2, 4).half()
    loss = m(x).float().mean() * 1e-2  # gradients of about 1e-3: g^2 (1-b2) ~ 1e-9 < 2^-24
    loss.backward()
    opt.step()
    v = opt.state[m[0].weight]["exp_avg_sq"]
    assert v.dtype == torch.float16 and (v == 0).any()
    h = judge(read_checkpoint(_save(tmp_path, {"model": m.state_dict(), "optimizer": opt.state_dict()})), FP16)
    flushed = [i for i in h.issues if i.code == "v_flushed"]
    assert flushed and flushed[0].dtype == "float16"
    assert {i.module for i in flushed} <= {"0", "2"}


def test_fp32_adam_in_a_healthy_run_is_never_flagged(tmp_path: Path) -> None:
    run_series(tmp_path, nan_at=None)
    for f in tmp_path.iterdir():
        assert not judge(read_checkpoint(f), FP16).damaged


def test_damaged_second_moment_breaks_the_bound(tmp_path: Path) -> None:
    run_series(tmp_path, nan_at=None, steps=10)
    ck = torch.load(tmp_path / "ckpt_step10.pt", weights_only=True)
    ck["optimizer"]["state"][2]["exp_avg_sq"] /= 1e4  # v a ten-thousandth of itself: |m| up to 100x its bound
    h = judge(read_checkpoint(_save(tmp_path, ck, "bad.pt")), FP16)
    bad = [i for i in h.issues if i.code == "moment_bound"]
    assert len(bad) == 1 and bad[0].name == "head.weight" and bad[0].value > 1


def test_moment_bound_at_default_betas() -> None:
    c = moment_bound(0.9, 0.999)
    assert c is not None and abs(c - 0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999))) < 1e-12 and 7.27 < c < 7.271
    assert moment_bound(0.99, 0.9) is None  # b1^2 >= b2: no bound


@settings(max_examples=40, deadline=None)
@given(b1=st.floats(0.0, 0.99), b2=st.floats(0.9, 0.9999), steps=st.integers(1, 60), seed=st.integers(0, 2**16),
       worst=st.booleans())
def test_adam_never_passes_the_bound(b1: float, b2: float, steps: int, seed: int, worst: bool) -> None:
    """torch's Adam, any betas with b1^2 < b2, random gradient histories and the one that attains the bound."""
    c = moment_bound(b1, b2)
    if c is None:
        return
    g = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.zeros(64))
    opt = torch.optim.Adam([p], betas=(b1, b2))
    scales = torch.logspace(-10, 10, 64)
    for k in range(steps):
        p.grad = (scales * (b1 / b2) ** (steps - 1 - k) if worst else torch.randn(64, generator=g) * scales).clone()
        opt.step()
    m, v = opt.state[p]["exp_avg"].double(), opt.state[p]["exp_avg_sq"].double()
    ratio = m.abs() / (c * v.sqrt())
    assert float(ratio.max()) <= 1 + MOMENT_SLACK


@pytest.mark.parametrize(("scale", "code"), [(2.0**-3, "scale_collapsed"), (0.0, "scale_zero"), (math.inf, "scale_nonfinite"),
                                             (2.0**-130, "scale_floor"), (2.0**16, None)])
def test_scaler_state(tmp_path: Path, scale: float, code: str | None) -> None:
    sc = torch.amp.GradScaler("cpu").state_dict()
    sc["scale"] = scale
    h = judge(read_checkpoint(_save(tmp_path, {"model": Mlp().state_dict(), "scaler": sc})), FP16)
    assert [i.code for i in h.issues] == ([code] if code else [])


def test_scale_fall_across_a_series(tmp_path: Path) -> None:
    """A scale that stays above 1 but fell 8 binades from the series' first (judge.scaler's collapse)."""
    for step, s in ((100, 2.0**16), (200, 2.0**12), (300, 2.0**7)):
        sc = torch.amp.GradScaler("cpu").state_dict()
        sc["scale"] = s
        _save(tmp_path, {"model": Mlp().state_dict(), "scaler": sc, "step": step}, f"s{step}.pt")
    r = cli(str(tmp_path / "s100.pt"), str(tmp_path / "s200.pt"), str(tmp_path / "s300.pt"))
    assert r.exit_code == 1
    assert "s300.pt (step 300)" in flat(r.output).split("first damaged: ")[1]
    assert "collapsed to 2^7, 9 binades below the series' first" in flat(r.output)


# ---------------------------------------------------------------------------------------------- layouts


def _trainer_folder(folder: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """A Trainer checkpoint folder as the Trainer writes one (model.safetensors, optimizer.pt, trainer_state.json)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def test_trainer_folders_by_step_with_decay_groups(tmp_path: Path) -> None:
    """The Trainer's two groups (decay, then biases and norms): the optimizer's entries named by shape and order."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    names = dict(m.named_parameters())
    decay = [names[n] for n in ("0.weight", "2.weight")]
    rest = [p for n, p in names.items() if n not in ("0.weight", "2.weight")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])
    for step in (5, 10, 15):
        loss = m(torch.randn(8, 4)).pow(2).mean()
        if step == 15:
            loss = loss * float("inf")
        opt.zero_grad()
        loss.backward()
        opt.step()
        _trainer_folder(tmp_path / "out" / f"checkpoint-{step}", m, opt, step)
    r = cli(str(tmp_path / "out"))
    assert r.exit_code == 1, r.output
    d = json.loads(cli(str(tmp_path / "out"), "--json", "-").stdout)
    assert d["first_damaged"].endswith("checkpoint-15") and d["last_good"].endswith("checkpoint-10")
    assert {(i["name"], i["part"]) for i in d["checkpoints"][2]["issues"]} >= {("1.weight", "exp_avg"), ("2.bias", "exp_avg_sq"),
                                                                                ("0.weight", "weight")}


def test_distributed_checkpoint_folder(tmp_path: Path) -> None:
    """dcp.save of get_state_dict's model and optimizer (an FSDP2 run's layout), read on one process, weights only."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = Mlp()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        m.fc1.weight[0, 0] = float("nan")
    msd, osd = get_state_dict(m, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "step-7"))
    d = json.loads(cli(str(tmp_path / "step-7"), "--json", "-").stdout)
    assert d["exit_code"] == 1
    assert [(i["code"], i["name"], i["count"]) for i in d["checkpoints"][0]["issues"]] == [("nonfinite", "fc1.weight", 1)]


def test_distributed_checkpoint_with_code_in_metadata_is_refused(tmp_path: Path) -> None:
    import pickle

    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    (folder / "__0_0.distcp").write_bytes(b"")
    r = cli(str(folder))
    assert r.exit_code == 2 and not (Path.cwd() / "PWNED").exists()
    assert "its .metadata holds pickled Python objects that checking does not load (posix.system)" in r.stderr


def test_one_checkpoint_in_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second layout unlike the dicts: a bare safetensors state_dict, healthy, then with a NaN and a weight beyond FP16."""
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    save_file({"a.weight": torch.tensor([1.0, 2.0])}, "ok.safetensors")
    r = cli("ok.safetensors")
    assert r.exit_code == 0 and flat(r.output).endswith("the checkpoint is healthy")
    save_file({"a.weight": torch.tensor([1.0, 7e4]), "a.bias": torch.tensor([float("nan")])}, "bad.safetensors")
    r = cli("bad.safetensors")
    assert r.exit_code == 1 and flat(r.output).endswith("bad.safetensors is damaged: do not resume from it")
    assert "a: - bias: NaN/Inf in the values (1 of 1) - weight: 1 of 2 values beyond fp16's max" in flat(r.output)
    assert cli("bad.safetensors", "--target", "bf16").exit_code == 1  # the NaN bias is damage in any format


def _adam_state(p: nn.Parameter, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {"w": p.detach().clone()}, "optimizer": opt.state_dict()}


@pytest.mark.parametrize("fused", [False, True])
def test_second_moment_falls_no_faster_than_beta2(tmp_path: Path, fused: bool) -> None:
    """The tight case of v' >= b2 v: gradients of exactly 0 for 200 updates (v decays by b2 each), then a v
    reset between two checkpoints (a third, unlike the first two: the step count goes on, the moments do not)."""
    from ampdoctor.judge.checkpoint_health import judge_series

    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64))
    opt = torch.optim.Adam([p], fused=fused)
    for _ in range(5):
        p.grad = torch.randn(64)
        opt.step()
    _save(tmp_path, _adam_state(p, opt), "a.pt")
    for _ in range(200):
        p.grad = torch.zeros(64)
        opt.step()
    _save(tmp_path, _adam_state(p, opt), "b.pt")
    ck = _adam_state(p, opt)
    ck["optimizer"]["state"][0]["exp_avg_sq"][:32] = 0  # half of v lost, the step count kept
    _save(tmp_path, ck, "c.pt")
    hs = [judge(read_checkpoint(tmp_path / n), FP16) for n in ("a.pt", "b.pt")]
    judge_series(list(hs))
    assert not hs[1].damaged
    hc = [judge(read_checkpoint(tmp_path / n), FP16) for n in ("b.pt", "c.pt")]
    judge_series(list(hc))
    fell = [i for i in hc[1].issues if i.code == "v_fell"]
    assert len(fell) == 1 and fell[0].name == "w" and fell[0].count == 0 and fell[0].value < 0.6
