"""Do no harm, beyond the bit-identical matrix (tests/test_transparency.py): what ampdoctor says reaches
the terminal without any logging setup, once; a failure inside ampdoctor is one warning and a monitor
that turns itself off while the training goes on exactly as it would have; a capture armed without
``batch=`` keeps the batch the forward consumed and replays to the right verdict at the right step."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor import Monitor
from ampdoctor.cli.app import app
from ampdoctor.engine.monitor import MonitorOffWarning, SkipRateWarning
from ampdoctor.errors import UsageError
from ampdoctor.notify import shown_path

ROOT = Path(__file__).resolve().parent.parent


def _py(code: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


# said without any logging setup, once -------------------------------------------------------------

@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_the_late_failure_and_its_capture_reach_stderr_without_logging_setup(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "sample_models" / "late_overflow.py"), "--steps", "160", "--capture",
                        str(tmp_path / "cap")], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    err = r.stderr
    assert err.count("ampdoctor: step 154 failed: the loss is inf; the step was skipped at scale 65536") == 1, err
    assert err.count(f"captured to {tmp_path / 'cap'}") == 1
    assert f"replay it: ampdoctor triage sample_models/late_overflow.py --from {tmp_path / 'cap'}" in err
    assert "Traceback" not in err
    # the warning names the script as below the working directory, not the machine's folder (``python x.py`` makes
    # __main__'s file absolute)
    assert re.match(r"sample_models/late_overflow\.py:\d+: ForecastWarning: ampdoctor: step 63: logits", err), err[:200]
    assert str(ROOT) not in err


def test_a_path_is_shown_below_the_working_directory_or_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    assert shown_path(tmp_path / "sub" / "train.py") == str(Path("sub") / "train.py")
    assert shown_path("sub/train.py") == "sub/train.py"  # as given
    assert shown_path(tmp_path.parent / "elsewhere.py") == str(tmp_path.parent / "elsewhere.py")
    assert shown_path(tmp_path.parent) == str(tmp_path.parent)


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_an_application_that_configured_logging_gets_each_event_once(tmp_path: Path) -> None:
    code = f"""
        import logging, sys, torch
        from torch import nn
        from ampdoctor import Monitor
        logging.basicConfig(stream=sys.stdout, format="APP %(name)s %(message)s")  # after importing ampdoctor
        torch.manual_seed(0)
        m = nn.Linear(4, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with Monitor(m, opt, capture={str(tmp_path / "cap")!r}) as mon:
            for i in range(3):
                x = torch.randn(8, 4)
                if i == 1:
                    x[0, 0] = float("nan")
                mon.step(m(x).pow(2).mean())
    """
    r = _py(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("APP ampdoctor ampdoctor: step 1 failed: the loss is nan") == 1, r.stdout
    assert "ampdoctor: step 1 failed" not in r.stderr  # not printed a second time by ampdoctor's own handler


def test_quiet_says_nothing(tmp_path: Path) -> None:
    code = """
        import torch
        from torch import nn
        from ampdoctor import Monitor
        m = nn.Linear(4, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with Monitor(m, opt, quiet=True, alert_min_steps=1, alert_rate=0.1) as mon:
            for i in range(3):
                mon.step(m(torch.full((8, 4), float("nan") if i == 1 else 1.0)).pow(2).mean())
    """
    r = _py(code, tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_the_skip_rate_warning_points_at_the_users_line() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, opt, alert_min_steps=2, alert_rate=0.2, window=4) as mon:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for i in range(4):
                x = torch.full((8, 4), float("nan")) if i in (1, 2) else torch.ones(8, 4)
                mon.step(model(x).pow(2).mean())
    alerts = [m for m in w if issubclass(m.category, SkipRateWarning)]
    assert len(alerts) == 1 and Path(alerts[0].filename).resolve() == Path(__file__).resolve()
    assert alerts[0].filename == shown_path(__file__)  # below the working directory: relative
    # factual: the reasons of the skips, not a guess at the cause
    assert "skip reasons: nonfinite_loss x" in str(alerts[0].message) and "range" not in str(alerts[0].message)


# misuse is a UsageError at once ---------------------------------------------------------------------

def test_misuse_names_the_argument() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="scaler: Monitor takes a torch.amp.GradScaler"):
        Monitor(model, opt, "cpu")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="optimizer: "):
        Monitor(model, "adam")  # type: ignore[arg-type]
    with Monitor(model, opt) as mon, pytest.raises(UsageError, match=r"step\(loss\): the loss must be the tensor"):
        mon.step(0.5)  # type: ignore[arg-type]


# a failure inside ampdoctor: one warning, off, the run unchanged ------------------------------------

def _train(broken: str | None, steps: int = 6) -> tuple[dict[str, torch.Tensor], list[Warning], Monitor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    mon = Monitor(model, opt, sc, max_norm=1.0)
    if broken == "stats":
        def boom(*a: object, **k: object) -> None:
            raise RuntimeError("statistics kernel exploded")
        mon.hooks.after_backward = boom  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x = torch.randn(16, 4, generator=g)
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x).float(), torch.zeros(16, 2))
            mon.step(loss)
    mon.close()
    return {k: v.clone() for k, v in model.state_dict().items()}, [x.message for x in w], mon  # type: ignore[misc]


@pytest.mark.parametrize("where", ["stats", "forward"])
def test_a_failure_inside_ampdoctor_turns_it_off_and_the_step_still_happens(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    good, w_good, _ = _train(None)
    if where == "forward":  # the Python recorder (not the C++ one), raising inside the user's forward
        import ampdoctor.watch.fused as fused
        from ampdoctor.watch.hooks import Hooks

        def bad_forward(*a: object, **k: object) -> None:
            raise RuntimeError("recorder exploded")

        monkeypatch.setattr(fused, "kernel", lambda: None)
        monkeypatch.setattr(Hooks, "after_call", bad_forward)
    bad, w_bad, mon = _train(where)
    offs = [m for m in w_bad if isinstance(m, MonitorOffWarning)]
    assert len(offs) == 1, w_bad
    assert "exploded" in str(offs[0]) and "at step 0" in str(offs[0]) and "training goes on" in str(offs[0])
    assert mon.off is not None and mon.step_num == 6
    assert not any(isinstance(m, MonitorOffWarning) for m in w_good)
    for k in good:  # the monitor's clip and the fallback's clip_grad_norm_ take the norm their own ways
        torch.testing.assert_close(bad[k], good[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("engine,said", [
    ("deepspeed", r"DeepSpeed is not supported yet"),
    ("fsdp2", r"FSDP2 \(fully_shard\) over a DTensor mesh of 1 rank\(s\) in a world of 2 .* is not supported yet"),
])
def test_an_unsupported_sharded_setup_is_one_warning_and_training_goes_on(monkeypatch: pytest.MonkeyPatch, engine: str,
                                                                         said: str) -> None:
    from ampdoctor.engine.monitor import building, monitor
    from ampdoctor.parallel.pieces import Shards

    class Unreducible(Shards):  # a layout the reduction cannot count right (replicas outside the mesh)
        def __init__(self, *a: object, **k: object) -> None:
            super().__init__(*a, **k)  # type: ignore[arg-type]
            self.problem = "a DTensor mesh of 1 rank(s) in a world of 2 (the replicas outside the mesh would count twice)"

    monkeypatch.setattr(monitor, "sharded_engine", lambda m: engine)
    monkeypatch.setattr(building, "Shards", Unreducible)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with pytest.warns(MonitorOffWarning, match=said):
        mon = Monitor(model, opt, log=None)
    loss = model(torch.ones(3, 4)).sum()
    rec = mon.step(loss)  # the step is taken, plainly
    assert not torch.equal(model.weight, before) and rec.step == 0 and mon.step_num == 1
    mon.close()


# a capture without batch= ---------------------------------------------------------------------------

SPEC = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]

def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)
'''


def test_a_capture_without_batch_keeps_the_forwards_inputs_and_replays_as_data(tmp_path: Path) -> None:
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    ns: dict[str, object] = {}
    exec(SPEC, ns)
    model = ns["build_model"]()  # type: ignore[operator]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # past calibration (GradScaler's own first skips, its normal working)
    g = torch.Generator().manual_seed(5)
    with Monitor(model, opt, sc, capture=tmp_path / "cap", snapshot_every=50, mode="sentinel", quiet=True) as mon:
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        for step in range(620):
            with mon.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            # the next batch is fetched after the forward, before the step (nanoGPT's loop): the capture must
            # keep the batch the forward consumed, not this one
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
            if step == 599:
                x[3, 2] = float("nan")  # the batch of step 600
            mon.step(loss)
            if mon.capture is not None and mon.capture.done:
                break
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["step"], m["reason"]) == (600, "nonfinite_loss")
    kept = torch.load(tmp_path / "cap" / "batches.pt", weights_only=True)[-1]["ampdoctor_model_inputs"]["args"][0]
    assert torch.isnan(kept[3, 2]) and int(torch.isnan(kept).sum()) == 1  # the forward's own batch
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    assert r.exit_code == 1, r.output
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 600), r.stdout[:2000]


def test_a_capture_with_nothing_to_keep_says_so_at_the_first_step(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, opt, capture=tmp_path / "cap") as mon, pytest.warns(UserWarning, match="has no batch to keep at step 0"):
        with torch.no_grad():
            out = model(torch.ones(2, 4))  # no training call of the model: nothing to keep
        mon.step((out.detach().requires_grad_() * 1).sum())


def test_the_forward_only_replay_says_so_and_a_sharded_capture_is_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    ns: dict[str, object] = {}
    exec(SPEC, ns)
    model = ns["build_model"]()  # type: ignore[operator]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt, capture=tmp_path / "cap", quiet=True) as mon:
        for step in range(3):
            x = torch.randn(8, 6)
            if step == 2:
                x[0, 0] = float("inf")
            mon.step(nn.functional.mse_loss(model(x), torch.zeros(8, 1)))
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 2)
    assert any("the replay ran the forward alone" in n for n in rep["notes"])
    mf = tmp_path / "cap" / "manifest.json"
    m = json.loads(mf.read_text())
    mf.write_text(json.dumps({**m, "sharded": "fsdp1", "rank": 1, "world_size": 2}))
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap")])
    assert r.exit_code == 2 and "without the layout that reassembles it" in r.output  # (no shards field)
    assert "Traceback" not in r.output
    layout = {k: {"shape": list(v.shape), "offset": [0] * v.dim()} for k, v in model.state_dict().items()}
    mf.write_text(json.dumps({**m, "sharded": "fsdp2", "rank": 1, "world_size": 2, "shards": {"model": layout}}))
    (tmp_path / "cap").rename(tmp_path / "cap.rank1")  # one rank's shard, the other rank's folder missing
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap.rank1")])
    assert r.exit_code == 2 and "rank 0's capture cap.rank0 is not beside it" in r.output and "Traceback" not in r.output


def test_a_monitor_that_cannot_be_set_up_is_one_warning_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.engine.monitor import building

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("no hooks for this model")

    monkeypatch.setattr(building, "Hooks", broken)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(MonitorOffWarning, match="setting up the monitor failed at step 0"):
        mon = Monitor(model, opt)
    mon.step(model(torch.ones(2, 4)).sum())  # trains on, plainly
    assert mon.off is not None and mon.step_num == 1


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_two_processes_capturing_into_one_folder_both_keep_theirs(tmp_path: Path) -> None:
    code = f"""
        import sys, time, torch
        from torch import nn
        from ampdoctor import Monitor
        go = float(sys.argv[1])
        torch.manual_seed(0)
        m = nn.Linear(4, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        mon = Monitor(m, opt, capture={str(tmp_path / "cap")!r}, quiet=True)
        mon.step(m(torch.ones(8, 4)).pow(2).mean())
        while time.time() < go:
            pass
        x = torch.ones(8, 4); x[0, 0] = float("nan")
        rec = mon.step(m(x).pow(2).mean(), batch=x)
        print(rec.capture)
    """
    import time

    go = time.time() + 8
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    written = sorted(o.strip() for o, _ in outs)
    assert len(set(written)) == 2 and all(written), outs  # two captures, two folders, neither lost
    for w in written:
        assert json.loads((Path(w) / "manifest.json").read_text())["step"] == 1


def test_the_capture_keeps_the_rng_as_the_failing_step_began(tmp_path: Path) -> None:
    """A step that draws randomness (dropout here) replays the run's own draw: rng.pt is the state as the
    failing step began, not after its draws."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt, capture=tmp_path / "cap", quiet=True) as mon:
        for step in range(4):
            x = torch.randn(8, 6)
            if step == 3:
                x[0, 0] = float("nan")
                began = torch.get_rng_state()
            mon.step(nn.functional.mse_loss(model(x), torch.zeros(8, 1)), batch=(x, torch.zeros(8, 1)))
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["step"], m["rng_after_step"]) == (3, 2)
    rng = torch.load(tmp_path / "cap" / "rng.pt", weights_only=True)
    assert torch.equal(rng["torch"], began)
