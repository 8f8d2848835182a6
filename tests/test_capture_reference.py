"""Capture by reference (``capture.reference``): a run that saves checkpoints captures its late failure as the
batches since its last checkpoint and a manifest naming it; ``triage --from`` starts from that checkpoint and
gives the verdict a snapshot capture of the same run gives."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor import Monitor, TriageConfig, triage
from ampdoctor.cli.app import app
from ampdoctor.errors import CaptureError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sample_models"))
import late_overflow  # noqa: E402

SAMPLE = ROOT / "sample_models" / "late_overflow.py"
pytestmark = pytest.mark.slow  # two 160-step runs of the Monitor (about 10 s of CPU) and their replays


def _own_loop(folder: Path, ckpt_dir: Path | None, save_every: int = 40, steps: int = 400) -> int:
    """late_overflow's own AMP loop with a Monitor; with ``ckpt_dir`` it saves the state dicts every ``save_every``
    steps (``torch.save``) and tells the Monitor (``mon.saved``). Returns the captured step."""
    model = late_overflow.build_model()
    opt = late_overflow.build_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    data = late_overflow.build_dataloader()
    with Monitor(model, opt, scaler, capture=folder, activations=False) as mon:
        for step in range(steps):
            x, y = data[step % len(data)]
            with mon.autocast():
                loss = late_overflow.loss_fn(model(x), y)
            if mon.step(loss, batch=(x, y)).capture:
                return step
            if ckpt_dir is not None and (step + 1) % save_every == 0:
                path = ckpt_dir / f"step-{step + 1}.pt"
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                            "step": step + 1}, path)
                mon.saved(path)
    return -1


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    base = tmp_path_factory.mktemp("ref")
    (base / "ckpt").mkdir()
    by_ref = _own_loop(base / "cap_ref", base / "ckpt")
    snap = _own_loop(base / "cap_snap", None)
    assert by_ref == snap > 100  # telling the Monitor changes nothing in the run
    return base / "cap_ref", base / "cap_snap", by_ref


def test_the_capture_is_the_batches_since_the_checkpoint_and_a_manifest(runs: tuple[Path, Path, int]) -> None:
    ref, snap, step = runs
    m = json.loads((ref / "manifest.json").read_text())
    last = step // 40 * 40  # the last save before the failure: step-N.pt holds the state step N starts from
    assert m["reference"] == {"kind": "checkpoint", "path": f"../ckpt/step-{last}.pt", "step": last}
    assert m["batch_steps"] == list(range(last, step + 1)) and m["snapshot_step"] == last
    assert "state.pt" not in m["files"] and "snapshot.pt" not in m["files"]
    size = sum(p.stat().st_size for p in ref.iterdir())
    snap_size = sum(p.stat().st_size for p in snap.iterdir())
    weights = sum(p.numel() * 4 * 3 for p in late_overflow.build_model().parameters())  # weights + Adam's two moments
    assert size < snap_size - weights  # no copy of the model's state


def test_triage_from_it_gives_the_snapshot_captures_verdict(runs: tuple[Path, Path, int]) -> None:
    ref, snap, step = runs
    a, _ = triage(SAMPLE, TriageConfig(), from_capture=ref)
    b, _ = triage(SAMPLE, TriageConfig(), from_capture=snap)
    want = ("fp16_forward_overflow", "logits", step)
    assert (a.verdict.cause, a.verdict.first_module, a.verdict.first_step) == want
    assert (b.verdict.cause, b.verdict.first_module, b.verdict.first_step) == want
    assert a.config["replay_step0"] == step // 40 * 40


def test_a_checkpoint_that_is_gone_is_one_line(runs: tuple[Path, Path, int], tmp_path: Path) -> None:
    ref, _, _ = runs
    moved = tmp_path / "elsewhere" / "cap"
    shutil.copytree(ref, moved)  # the capture mailed without its checkpoint
    with pytest.raises(CaptureError, match=r"starts from the run's checkpoint .*step-\d+\.pt \(step \d+\), which is not "
                                           r"there; put the checkpoint back beside the capture"):
        triage(SAMPLE, TriageConfig(), from_capture=moved)
    res = CliRunner().invoke(app, ["triage", str(SAMPLE), "--from", str(moved)])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_no_checkpoint_keeps_the_snapshot(runs: tuple[Path, Path, int]) -> None:
    _, snap, _ = runs
    m = json.loads((snap / "manifest.json").read_text())
    assert "reference" not in m and ("snapshot.pt" in m["files"] or "state.pt" in m["files"])


class _Wrapped(nn.Module):
    """late_overflow's model as a Trainer model: its loss in the output."""

    def __init__(self) -> None:
        super().__init__()
        self.net = late_overflow.build_model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": late_overflow.loss_fn(out, labels), "logits": out}


TRAINER_SPEC = f'''
import sys
sys.path.insert(0, {str(ROOT / "sample_models")!r})
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_capture_reference import _Wrapped


def build_model():
    return _Wrapped()
'''


def _trainer_run(tmp: Path, save: bool) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from ampdoctor.integrations.transformers import AmpDoctorCallback

    class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.items = [(x[i], y[i]) for x, y in late_overflow.build_dataloader() for i in range(4)]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.items[i][0], "labels": self.items[i][1]}

    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    model = _Wrapped()
    opt = late_overflow.build_optimizer(model.parameters())
    cb = AmpDoctorCallback(log=None, capture=tmp / "cap")
    args = TrainingArguments(str(tmp / "out"), per_device_train_batch_size=4, max_steps=260, use_cpu=True, report_to=[],
                             logging_steps=50, save_strategy="steps" if save else "no", save_steps=50, disable_tqdm=True,
                             seed=0, fp16=True, lr_scheduler_type="constant")
    tr = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None), callbacks=[cb])
    tr.accelerator.scaler = torch.amp.GradScaler("cpu")  # what accelerate makes on a GPU (tests/test_integration_trainer.py)
    tr.accelerator.native_amp = True
    tr.train()
    return tmp / "cap"


@pytest.mark.slow
def test_a_trainer_run_that_saves_checkpoints_captures_by_reference(tmp_path: Path) -> None:
    ref = _trainer_run(tmp_path / "a", save=True)
    snap = _trainer_run(tmp_path / "b", save=False)
    m = json.loads((ref / "manifest.json").read_text())
    ms = json.loads((snap / "manifest.json").read_text())
    assert m["step"] == ms["step"] > 50
    last = (m["step"] - 1) // 50 * 50  # checkpoint-N is saved after the Trainer's step N: the state step N + 1 starts from
    assert m["reference"] == {"kind": "checkpoint", "path": f"../out/checkpoint-{last}", "step": last + 1}
    assert m["batch_steps"] == list(range(last + 1, m["step"] + 1))
    assert "state.pt" not in m["files"] and "snapshot.pt" not in m["files"]
    spec = tmp_path / "spec.py"
    spec.write_text(TRAINER_SPEC)
    said = []
    for cap in (ref, snap):
        r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(cap), "-q"])
        said.append(r.stdout.strip().splitlines()[-1])
    assert said[0] == said[1] == f"fp16_forward_overflow module=net.logits step={m['step']} stage=amp"
