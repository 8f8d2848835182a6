"""Under the Trainer, Lightning and accelerate, a failing step is one message, and its replay hint asks for no spec
when the capture rebuilds the model and its loss (issue 45 item 5): each run is the user's own script beside its
model module, in a subprocess from a temporary folder, and ``ampdoctor triage --from cap`` then replays it from there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # three framework runs in subprocesses, with their triage

MODEL = '''
import torch
from torch import nn


class Reg(nn.Module):
    """A regression whose loss is its own (labels in the batch), as Hugging Face models are."""

    def __init__(self, d=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, d), nn.GELU(), nn.Linear(d, 1))

    def forward(self, x, labels):
        out = self.body(x)
        return {"loss": nn.functional.mse_loss(out.float(), labels), "logits": out}


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.embed, self.head = nn.Linear(16, d), nn.Linear(d, 4)

    def forward(self, x):
        return self.head(torch.relu(self.embed(x)))


def data(n, bad):
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
    xs[bad, 3] = float("nan")
    return xs, ys
'''

LIT = '''
import lightning as L
import torch
from torch import nn


class Lit(L.LightningModule):
    def __init__(self, d=16):
        super().__init__()
        self.save_hyperparameters()
        self.embed, self.head = nn.Linear(16, d), nn.Linear(d, 4)

    def forward(self, x):
        return self.head(torch.relu(self.embed(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
'''

TRAINER = '''
import torch
from transformers import Trainer, TrainingArguments
from ampdoctor.integrations.transformers import AmpDoctorCallback
from mymodel import Reg

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        if i == 41:
            x[2] = float("nan")
        return {"x": x, "labels": torch.randn(1, generator=g)}

torch.manual_seed(0)
args = TrainingArguments("out", per_device_train_batch_size=8, max_steps=8, use_cpu=True, report_to=[],
                         save_strategy="no", disable_tqdm=True, seed=0, bf16=True, logging_steps=1)
Trainer(model=Reg(d=24), args=args, train_dataset=Data(), callbacks=[AmpDoctorCallback(log=None, capture="cap")]).train()
'''

LIGHTNING = '''
import lightning as L
import torch
from ampdoctor.integrations.lightning import AmpDoctorCallback
from mymodel import data
from litmodel import Lit

xs, ys = data(64, 40)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8)
torch.manual_seed(0)
tr = L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[AmpDoctorCallback(log=None, capture="cap")])
tr.fit(Lit(d=24), dl)
'''

ACCELERATE = '''
import torch
from torch import nn
from accelerate import Accelerator
from ampdoctor.integrations.accelerate import watch
from mymodel import Net, data

acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = Net(d=24)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
xs, ys = data(64, 40)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8)
model, opt, dl = acc.prepare(model, opt, dl)
mon = watch(acc, model, opt, log=None, capture="cap")
for x, y in dl:
    loss = nn.functional.cross_entropy(model(x).float(), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
mon.close()
'''


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.parametrize("framework", ["trainer", "lightning", "accelerate"])
def test_one_message_and_a_hint_that_asks_for_no_spec(framework: str, tmp_path: Path) -> None:
    pytest.importorskip({"trainer": "transformers", "lightning": "lightning", "accelerate": "accelerate"}[framework])
    (tmp_path / "mymodel.py").write_text(MODEL)
    (tmp_path / "litmodel.py").write_text(LIT)
    (tmp_path / "train.py").write_text({"trainer": TRAINER, "lightning": LIGHTNING, "accelerate": ACCELERATE}[framework])
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("ampdoctor: step")]
    assert len(said) == 1 and " failed: the loss is nan" in said[0], r.stderr[-3000:]  # one message for the event
    if framework == "trainer":
        assert "the Trainer's own log hides it" in said[0]
    assert "replay it: ampdoctor triage --from cap" in r.stderr and "SPEC" not in r.stderr, r.stderr[-3000:]
    step = json.loads((tmp_path / "cap" / "manifest.json").read_text())["step"]
    t = subprocess.run([sys.executable, "-c", "from ampdoctor.cli.app import main; main()", "triage", "--from", "cap",
                        "--json", "-", "-q"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400)
    assert t.returncode == 1, t.stderr[-3000:]
    rep = json.loads(t.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", step), t.stderr[-2000:]
