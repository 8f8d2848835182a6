"""A LightningModule importable by path, for the spec-free replays of tests/test_integration_lightning.py."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn


class LitNet(L.LightningModule):
    """Its loss lives in ``training_step`` (``forward`` returns logits), its optimizer has two groups."""

    def __init__(self, hidden: int = 32, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, hidden)
        self.body = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        return {"optimizer": torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                               lr=self.hparams.lr)}
