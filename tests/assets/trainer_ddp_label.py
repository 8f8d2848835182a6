"""A transformers Trainer run under torchrun (2 CPU processes, gloo) whose sample 37 holds a NaN *label*.

The model is a regression that reads its labels only in its own loss (as Hugging Face models do): no module
reads them, so the rank that got the sample must be named with ``input`` and the batch's labels, not a module
(issue 45). Used by tests/test_issue45_words.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from ampdoctor.integrations.transformers import AmpDoctorCallback

BAD = 37


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.head(torch.relu(self.embed(x)))
        return {"loss": nn.functional.mse_loss(out.float().squeeze(-1), labels), "logits": out}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 128

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        y = torch.randn((), generator=g)
        if i == BAD:
            y = torch.tensor(float("nan"))
        return {"x": torch.randn(16, generator=g), "labels": y}


def main() -> None:
    out = Path(sys.argv[1])
    args = TrainingArguments(str(out / "trainer"), per_device_train_batch_size=4, max_steps=12, use_cpu=True, bf16=True,
                             report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                             ddp_backend="gloo")
    cb = AmpDoctorCallback(log=out / "steps.csv", capture=out / "cap")
    Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=[cb]).train()
    if torch.distributed.is_initialized():  # the Trainer leaves its process group up; gloo can abort at exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from _job import end_job

    main()
    end_job()
