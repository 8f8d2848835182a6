"""Capture the failing step of a long run with the Monitor, then replay it with `triage --from`."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ampdoctor import Monitor, TriageConfig, triage
from ampdoctor.capture.read import read_capture
from ampdoctor.cli.app import app
from ampdoctor.errors import CaptureError

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_models" / "late_overflow.py"
sys.path.insert(0, str(ROOT / "sample_models"))
import late_overflow  # noqa: E402


def train_until_capture(folder: Path, steps: int = 400, snapshot_every: int = 100,
                        log: Path | None = None) -> tuple[int, list[int]]:
    """The sample's own loop; returns the captured step and every step the Monitor skipped."""
    model = late_overflow.build_model()
    opt = late_overflow.build_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    data = late_overflow.build_dataloader()
    captured, skipped = -1, []
    with Monitor(model, opt, scaler, capture=folder, snapshot_every=snapshot_every, activations=False, log=log) as mon:
        for step in range(steps):
            x, y = data[step % len(data)]
            with mon.autocast():
                loss = late_overflow.loss_fn(model(x), y)
            rec = mon.step(loss, batch=(x, y))
            if rec.skipped:
                skipped.append(rec.step)
            if rec.capture:
                captured = rec.step
                break
    return captured, skipped


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp("run") / "cap"
    step, skipped = train_until_capture(folder, log=folder.parent / "steps.csv")
    assert step > 100, f"the sample must train cleanly for over 100 steps (failed at {step})"
    assert skipped == [step], "the first skip is the failing step: nothing before it"
    return folder, step


def test_capture_holds_the_state_before_the_failing_step(capture: tuple[Path, int]) -> None:
    folder, step = capture
    m = json.loads((folder / "manifest.json").read_text())
    assert (m["step"], m["reason"], m["skipped"], m["precision"]) == (step, "nonfinite_loss", True, "amp")
    assert m["scale"] == 65536.0 and m["snapshot_step"] == 100 and m["batch_steps"][-1] == step
    assert m["batch_steps"] == list(range(100, step + 1))
    assert m["step_log"] == str(folder.parent / "steps.csv")  # where `ampdoctor scaler` reads the run's history
    for name in ("state.pt", "snapshot.pt", "batches.pt", "rng.pt"):
        torch.load(folder / name, weights_only=True)  # loads without trusting pickles
    cap = read_capture(folder)
    assert cap.start.step0 == step and len(cap.batches) == 1 and not cap.from_snapshot
    assert cap.start.scaler is not None and cap.start.scaler["scale"] == 65536.0


def test_triage_from_initial_weights_is_healthy() -> None:
    report, _ = triage(SAMPLE, TriageConfig(steps=20))
    assert report.verdict.cause == "healthy"


def test_triage_from_the_capture_names_cause_module_and_the_runs_step(capture: tuple[Path, int]) -> None:
    folder, step = capture
    report, run = triage(SAMPLE, TriageConfig(), from_capture=folder)
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("fp16_forward_overflow", "logits", step, "amp")
    assert run.replay is not None and run.replay.reproduced == 2
    fp32 = next(s for s in report.stages if s.name == "fp32")
    assert fp32.first_nonfinite_step is None, "FP32 from the captured weights is finite: a range problem"
    amp = next(s for s in report.stages if s.name == "amp")
    assert amp.skipped_steps == [step] and amp.scales == [65536.0]
    assert report.layers[0].module == "logits > matmul" and report.layers[0].absmax_fp32 > 65504
    # the scale history of the run is in the step log it kept, named as the Monitor was given it
    assert report.scaler is not None and f"`ampdoctor scaler {folder.parent / 'steps.csv'}`" in report.scaler.explanation


def test_the_replay_says_the_runs_own_step_in_every_sentence(capture: tuple[Path, int]) -> None:
    """The words are written after the replay's steps are shifted: never the replay-relative 'step 0'."""
    folder, step = capture
    report, _ = triage(SAMPLE, TriageConfig(), from_capture=folder)
    assert f"at step {step}" in report.verdict.summary, report.verdict.summary
    assert "step 0" not in report.verdict.summary
    assert report.findings[0].step == step and "step 0" not in report.findings[0].title + report.findings[0].fix


def test_cli_from_capture_without_a_dataloader(capture: tuple[Path, int], tmp_path: Path) -> None:
    folder, step = capture
    spec = tmp_path / "spec.py"
    spec.write_text(SAMPLE.read_text().replace("def build_dataloader(", "def _unused_dataloader("))
    res = CliRunner().invoke(app, ["triage", str(spec), "--from", str(folder), "-q"])
    assert res.exit_code == 1, res.output
    assert res.output.strip() == f"fp16_forward_overflow module=logits step={step} stage=amp"


def _capture_step_one(folder: Path) -> int:
    """A tiny AMP loop whose second step's loss overflows FP16 (x 1e5 squared): the captured step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Monitor(model, opt, torch.amp.GradScaler("cpu"), capture=folder, activations=False) as mon:
        for step in range(3):
            x = torch.ones(8, 4) * (1e5 if step == 1 else 1.0)
            with mon.autocast():
                loss = model(x).pow(2).mean()
            if mon.step(loss, batch=(x,)).capture:
                return step
    return -1


def test_an_existing_capture_is_never_overwritten(tmp_path: Path) -> None:
    first = tmp_path / "cap"
    assert _capture_step_one(first) == 1
    before = (first / "manifest.json").read_bytes()
    assert _capture_step_one(first) == 1  # the same failure again: a second folder beside the first
    assert (first / "manifest.json").read_bytes() == before
    assert json.loads((tmp_path / "cap-1" / "manifest.json").read_text())["step"] == 1


def test_replay_of_a_transient_says_not_reproduced(capture: tuple[Path, int], tmp_path: Path) -> None:
    folder, step = capture
    flaky = tmp_path / "flaky"
    shutil.copytree(folder, flaky)
    # the same run, but the captured weights are pulled back a little: the failing batch now fits FP16,
    # as when the failure came from a transient fault rather than from the weights and the batch
    st = torch.load(flaky / "state.pt", weights_only=True)
    st["model"] = {k: v * 0.5 for k, v in st["model"].items()}
    torch.save(st, flaky / "state.pt")
    report, run = triage(SAMPLE, TriageConfig(), from_capture=flaky)
    assert report.verdict.cause == "not_reproduced" and report.verdict.first_step == step
    assert run.replay is not None and run.replay.reproduced == 0


@pytest.mark.parametrize("damage", ["truncated", "no_manifest", "other_model"])
def test_bad_captures_are_one_line(capture: tuple[Path, int], tmp_path: Path, damage: str) -> None:
    folder, _ = capture
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    if damage == "truncated":
        data = (bad / "state.pt").read_bytes()
        (bad / "state.pt").write_bytes(data[: len(data) // 2])
        spec = SAMPLE
    elif damage == "no_manifest":
        (bad / "manifest.json").unlink()
        spec = SAMPLE
    else:
        spec = tmp_path / "other.py"
        spec.write_text(SAMPLE.read_text().replace("d: int = 16", "d: int = 8").replace("torch.randn(4, 8, 16,", "torch.randn(4, 8, 8,"))
    with pytest.raises(CaptureError):
        triage(spec, TriageConfig(), from_capture=bad)
    res = CliRunner().invoke(app, ["triage", str(spec), "--from", str(bad)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def _train_plain(steps: int) -> dict[str, object]:
    """The sample's loop without ampdoctor, saving a checkpoint as PyTorch's AMP recipe does."""
    model = late_overflow.build_model()
    opt = late_overflow.build_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    data = late_overflow.build_dataloader()
    for step in range(steps):
        x, y = data[step % len(data)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = late_overflow.loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(), "step": steps}


def test_triage_from_a_checkpoint_numbers_steps_as_the_run(capture: tuple[Path, int], tmp_path: Path) -> None:
    _, failing = capture
    start = failing - 4
    ckpt = tmp_path / "ckpt.pt"
    torch.save(_train_plain(start), ckpt)
    n = len(late_overflow.build_dataloader())
    report, run = triage(SAMPLE, TriageConfig(steps=8), checkpoint=ckpt, skip_batches=start % n)
    v = report.verdict
    assert (v.cause, v.first_module, v.stage) == ("fp16_forward_overflow", "logits", "amp")
    assert start <= v.first_step <= failing, "the failure shows at the run's own step, within a few steps of the capture's"
    assert f"step {v.first_step}" in v.summary
    assert any(n.startswith(f"started from the dict checkpoint {ckpt}") for n in report.notes)
    from ampdoctor.render.markdown import reproduce_command

    cmd = reproduce_command(report) or ""
    assert f"--checkpoint {ckpt}" in cmd and f"--skip-batches {start % n}" in cmd
    res = CliRunner().invoke(app, ["triage", str(SAMPLE), "--checkpoint", str(ckpt), "--skip-batches", str(start % n),
                                   "--steps", "8", "-q"])
    assert res.exit_code == 1 and res.output.strip() == f"fp16_forward_overflow module=logits step={v.first_step} stage=amp"


def test_a_checkpoint_it_cannot_read_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "ckpt.pt"
    torch.save({"epoch": 3, "notes": "no weights here"}, bad)
    res = CliRunner().invoke(app, ["triage", str(SAMPLE), "--checkpoint", str(bad), "--steps", "2"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1 and str(bad.name) in res.output


def test_the_ticket_report_reproduces_the_replay(capture: tuple[Path, int]) -> None:
    from ampdoctor.render.markdown import reproduce_command

    folder, step = capture
    report, _ = triage(SAMPLE, TriageConfig(), from_capture=folder)
    cmd = reproduce_command(report)
    assert cmd is not None and f"--from {folder}" in cmd
    assert report.config["from_capture"] == str(folder) and report.config["replay_step0"] == step
