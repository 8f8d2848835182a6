"""A transformers Trainer run under torchrun (2 CPU processes, gloo) with AmpDoctorCallback.

Sample 37 of the dataset holds an Inf; the Trainer's distributed sampler hands it to one rank at
one step. Every rank's log must name that rank (kind ``input``), the module that read it first, and
the step; only that rank writes a capture. Used by tests/test_distributed.py::test_trainer_under_torchrun.
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
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.relu(self.embed(x)))
        return {"loss": nn.functional.cross_entropy(logits.float(), labels), "logits": logits}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 128

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, generator=g)
        if i == BAD:
            x[3] = float("inf")
        return {"x": x, "labels": torch.tensor(i % 4)}


def main() -> None:
    out = Path(sys.argv[1])
    args = TrainingArguments(str(out / "trainer"), per_device_train_batch_size=4, max_steps=12, use_cpu=True, bf16=True,
                             report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                             ddp_backend="gloo")
    cb = AmpDoctorCallback(log=out / "steps.csv", capture=out / "cap")
    Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=[cb]).train()
    if torch.distributed.is_initialized():  # the Trainer leaves its process group up; gloo can abort at exit
        torch.distributed.destroy_process_group()  # without this (pytorch/pytorch#190489)


if __name__ == "__main__":
    from _job import end_job

    main()
    end_job()
