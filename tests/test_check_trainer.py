"""End to end with a real transformers Trainer (slow: CI runs ``pytest -m slow``): a run that goes NaN at step 130
saves poisoned checkpoints, the callback warns at the first such save, ``ampdoctor check`` names the first damaged
and the last good; a run with ``report_to="tensorboard"`` shows the ampdoctor figures in its event file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402

from ampdoctor.cli.app import app  # noqa: E402
from ampdoctor.integrations.transformers import AmpDoctorCallback  # noqa: E402

pytestmark = pytest.mark.slow
NAN_STEP = 130


class Reg(torch.nn.Module):
    """Its loss is NaN at the Trainer's step ``NAN_STEP`` (its 130th training forward): a NaN loss, as a bad batch
    gives, that the fp32 Trainer applies (no GradScaler to skip it), poisoning every weight and Adam moment."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += self.training
        out = self.body(x)
        loss = torch.nn.functional.mse_loss(out, labels)
        return {"loss": loss * float("nan") if self.calls == NAN_STEP else loss, "logits": out}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4 * 150

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)}


def _args(out: Path, **kw: object) -> TrainingArguments:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    base = dict(per_device_train_batch_size=4, use_cpu=True, disable_tqdm=True, seed=0, dataloader_drop_last=True)
    return TrainingArguments(str(out), **{**base, **kw})  # type: ignore[arg-type]


def test_a_run_that_went_nan_at_step_130(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    args = _args(tmp_path / "run", max_steps=150, save_steps=10, save_strategy="steps", report_to=[], logging_steps=10,
                 save_only_model=False)
    tr = Trainer(model=Reg(), args=args, train_dataset=Data(), callbacks=[AmpDoctorCallback(log=None)])
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        tr.train()
    saves = [r.getMessage() for r in caplog.records if "saving to" in r.getMessage()]
    assert len(saves) == 1, saves  # once, at the first save after the damage
    assert f"checkpoint-{NAN_STEP}" in saves[0] and f"step {NAN_STEP} applied a non-finite update" in saves[0]
    r = CliRunner().invoke(app, ["check", str(tmp_path / "run"), "--json", "-"], env={"COLUMNS": "80"})
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["first_damaged"].endswith(f"checkpoint-{NAN_STEP}") and d["last_good"].endswith("checkpoint-120")
    bad = d["checkpoints"][12]
    assert bad["step"] == NAN_STEP and {i["module"] for i in bad["issues"]} == {"body.0", "body.2"}
    assert {i["part"] for i in bad["issues"]} == {"weight", "exp_avg", "exp_avg_sq"}
    healthy = CliRunner().invoke(app, ["check", *(str(tmp_path / "run" / f"checkpoint-{s}") for s in (10, 60, 120))])
    assert healthy.exit_code == 0, healthy.output


def test_report_to_tensorboard_shows_the_figures(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = _args(tmp_path / "run", max_steps=12, save_strategy="no", report_to=["tensorboard"], logging_steps=2)
    tr = Trainer(model=Reg(), args=args, train_dataset=Data(), callbacks=[AmpDoctorCallback(log=None, figures=True)])
    tr.train()
    events = [p.parent for p in tmp_path.rglob("events.out.tfevents.*")]
    assert events
    ea = EventAccumulator(str(events[0]))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/ampdoctor/headroom_min", "train/ampdoctor/skips", "train/ampdoctor/skip_rate"} <= tags, tags
    assert any(t.startswith("train/ampdoctor/headroom/body.") for t in tags)
    assert [e.step for e in ea.Scalars("train/ampdoctor/headroom_min")] == [2, 4, 6, 8, 10, 12]
