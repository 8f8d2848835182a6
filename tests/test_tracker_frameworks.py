"""Lightning and accelerate: the figures in the framework's own logging (``log_dict``, ``accelerator.log``) and
the save-time warning (``on_save_checkpoint``, ``save_state``'s pre-hook), on tiny real runs on the CPU."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

NAN_STEP = 3


class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(2, generator=g)


@pytest.mark.slow  # Lightning's start-up: about 30 s on this machine
def test_lightning_log_dict_and_save_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    L = pytest.importorskip("lightning")
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    from ampdoctor.integrations.lightning import AmpDoctorCallback

    class Net(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.body(x), y)
            return loss * float("nan") if self.global_step == NAN_STEP else loss  # applied in fp32: poisons the weights

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    cb = AmpDoctorCallback(log=None, figures=True)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=CSVLogger(str(tmp_path), name="run"), log_every_n_steps=1,
                        callbacks=[cb], enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        trainer.fit(Net(), torch.utils.data.DataLoader(_Data(), batch_size=4))
        trainer.save_checkpoint(tmp_path / "last.ckpt")  # after the NaN step: said once
        trainer.save_checkpoint(tmp_path / "again.ckpt")
    metrics = pd.read_csv(next(tmp_path.rglob("metrics.csv")))
    assert {"ampdoctor/headroom_min", "ampdoctor/skips", "ampdoctor/skip_rate"} <= set(metrics.columns)
    assert metrics["ampdoctor/headroom_min"].notna().sum() >= 5
    saves = [r.getMessage() for r in caplog.records if "ampdoctor: saving" in r.getMessage()]
    assert len(saves) == 1 and f"step {NAN_STEP} applied a non-finite update" in saves[0]


def test_accelerate_log_and_save_state_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("tensorboard")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ampdoctor.integrations.accelerate import watch

    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    acc.init_trackers("run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters())
    data = torch.utils.data.DataLoader(_Data(), batch_size=4)
    model, opt, data = acc.prepare(model, opt, data)
    mon = watch(acc, model, opt, log=None, figures=True)
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        for step, (x, y) in enumerate(data):
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss * float("nan") if step == NAN_STEP else loss)
            opt.step()
            opt.zero_grad()
        acc.save_state(str(tmp_path / "state"))
    mon.close()
    acc.end_training()
    saves = [r.getMessage() for r in caplog.records if "ampdoctor: saving" in r.getMessage()]
    assert len(saves) == 1 and f"step {NAN_STEP} applied a non-finite update" in saves[0] and "state" in saves[0]
    ea = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    ea.Reload()
    assert [e.step for e in ea.Scalars("ampdoctor/skip_rate")] == list(range(8))
