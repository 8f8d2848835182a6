"""Writes tests/assets/lightning.ckpt with a real Lightning Trainer (fp16 AMP on the CPU, 3 steps).

The test reads the file without Lightning installed. Regenerate: pip install lightning && python tests/assets/make_lightning_ckpt.py
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()
        self.register_buffer("loss_weight", torch.tensor(0.5))  # a key outside "model."

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        return self.loss_weight * torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader([(torch.randn(4), torch.randn(1)) for _ in range(8)], batch_size=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Module(), data)
    trainer.save_checkpoint(Path(__file__).with_name("lightning.ckpt"))


if __name__ == "__main__":
    main()
