"""Issue 45 under the frameworks, each with its defaults and ``GradScaler()`` untouched (init 2^16, growth_interval
2000): gradients that grow over the first steps make GradScaler back off several times after it has carried steps;
none of those back-offs takes the capture, and the NaN batch (or label) later is captured at its own step. Slow: each
runs a real framework loop on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.watch.steplog_read import read_step_log

pytestmark = pytest.mark.slow

NAN_AT = 24
"""The batch (0-based) that holds the NaN."""


def _batches(n: int = 30) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Targets that grow 1.12x a batch for 20 batches (the gradients with them), a NaN in batch ``NAN_AT``."""
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n):
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g) * 1.12 ** min(k, 20)
        if k == NAN_AT:
            x[3, 5] = float("nan")
        out.append((x, y))
    return out


SPEC = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y, reduction="sum")
'''


def _model() -> nn.Module:
    ns: dict[str, object] = {}
    exec(SPEC, ns)
    return ns["build_model"]()  # type: ignore[operator,no-any-return]


def _back_offs_then_the_nan(log_path: Path, cap: Path, nan_step: int) -> None:
    log = read_step_log(log_path).frame
    applied = set(log.loc[~log["skipped"].astype(bool), "step"])
    established = [s for s in log.loc[log["skipped"].astype(bool), "step"] if s < nan_step and any(a < s for a in applied)]
    assert len(established) >= 2, log[["step", "scaler_scale", "skipped"]].to_string()  # ordinary back-offs
    m = json.loads((cap / "manifest.json").read_text())
    assert (m["step"], m["reason"]) == (nan_step, "nonfinite_loss")
    assert not any(p.name.startswith(cap.name + "-") for p in cap.parent.iterdir())  # one capture, the failure's


def _triage(tmp: Path, cap: Path, spec_text: str = SPEC) -> dict[str, object]:
    spec = tmp / "spec.py"
    spec.write_text(spec_text)
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(cap), "--json", "-", "-q"])
    return json.loads(r.stdout)["verdict"]  # type: ignore[no-any-return]


def test_accelerate_defaults(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ampdoctor.integrations.accelerate import watch

    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    acc.scaler = torch.amp.GradScaler("cpu")  # what accelerate makes on a GPU: every default
    acc.native_amp = True
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model, opt = acc.prepare(model, opt)
    mon = watch(acc, model, opt, log=tmp_path / "steps.csv", capture=tmp_path / "cap", quiet=True)
    for x, y in _batches():
        loss = nn.functional.mse_loss(model(x).float(), y, reduction="sum")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    _back_offs_then_the_nan(tmp_path / "steps.csv", tmp_path / "cap", NAN_AT)
    v = _triage(tmp_path, tmp_path / "cap")
    assert (v["cause"], v["first_step"]) == ("data", NAN_AT), v


def test_lightning_defaults(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning")
    from lightning.pytorch.plugins import MixedPrecision

    from ampdoctor.integrations.lightning import AmpDoctorCallback

    class Net(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # type: ignore[no-any-return]

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x).float(), y, reduction="sum")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-6)

    data = torch.utils.data.DataLoader(_batches(), batch_size=None)
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap", quiet=True)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))  # Lightning's GPU plugin, defaults
    tr = L.Trainer(accelerator="cpu", max_steps=30, callbacks=[cb], logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, plugins=[plugin])
    tr.fit(Net(), data)
    _back_offs_then_the_nan(tmp_path / "steps.csv", tmp_path / "cap", NAN_AT)


class _Growing(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A tiny BERT regression whose labels grow 1.3x a step for 16 steps (its gradients with them); a NaN label in
    the batch of the Trainer's step 25."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        for step in range(1000):
            for j in range(8):
                g = torch.Generator().manual_seed(step * 8 + j)
                lab = torch.tensor(float(j % 3 - 1) * 3.0 * 1.3 ** min(step, 16))
                if step == 24 and j == 2:
                    lab = torch.tensor(float("nan"))
                yield {"input_ids": torch.randint(0, 64, (16,), generator=g), "labels": lab}


BERT_SPEC = '''
import torch
from transformers import BertConfig, BertForSequenceClassification

def build_model():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=1))
'''


def test_trainer_defaults_fused_adamw(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from ampdoctor.integrations.transformers import AmpDoctorCallback

    AcceleratorState._reset_state(reset_partial_state=True)
    ns: dict[str, object] = {}
    exec(BERT_SPEC, ns)
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap", quiet=True)
    args = TrainingArguments(str(tmp_path / "trainer"), per_device_train_batch_size=8, max_steps=28, use_cpu=True,
                             report_to=[], logging_steps=100, save_strategy="no", disable_tqdm=True, seed=0, fp16=True)
    tr = Trainer(model=ns["build_model"](), args=args, train_dataset=_Growing(), callbacks=[cb])  # type: ignore[operator]
    tr.accelerator.scaler = torch.amp.GradScaler("cpu")  # what accelerate makes on a GPU: every default
    tr.accelerator.native_amp = True
    tr.train()
    assert str(tr.args.optim.value) == "adamw_torch_fused"  # the Trainer's default optimizer
    _back_offs_then_the_nan(tmp_path / "steps.csv", tmp_path / "cap", 25)
    v = _triage(tmp_path, tmp_path / "cap", BERT_SPEC)
    assert (v["cause"], v["first_step"]) == ("data", 25), v
    assert "labels" in str(v["summary"])


def test_accelerate_defaults_a_persistent_overflow_is_reported_at_its_first_skip(tmp_path: Path) -> None:
    # a summed-token loss: 2000 tokens a step, then 16000 from step 30: the unscaled gradients leave FP16 there
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ampdoctor.integrations.accelerate import watch

    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    acc.scaler = torch.amp.GradScaler("cpu")
    acc.native_amp = True
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-12)
    model, opt = acc.prepare(model, opt)
    mon = watch(acc, model, opt, log=tmp_path / "steps.csv", capture=tmp_path / "cap", quiet=True)
    g = torch.Generator().manual_seed(1)
    for step in range(36):
        n = 2000 if step < 30 else 16000
        x, y = torch.rand(n, 8, generator=g), torch.full((n, 1), 4.0)
        acc.backward(nn.functional.mse_loss(model(x).float(), y, reduction="sum"))
        opt.step()
        opt.zero_grad()
    mon.close()
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    assert bool(log.loc[30, "skipped"]) and bool(log.loc[31, "skipped"]) and not bool(log.loc[29, "skipped"])
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["first_skip"], m["snapshot_step"], m["batch_steps"][0], m["reason"]) == (30, 30, 30, "nonfinite_grad")
    assert mon.first_failure == (30, "nonfinite_grad")  # type: ignore[attr-defined]
