"""The transformers ``Trainer`` with ``AmpDoctorCallback``: a tiny BERT trained for real on the CPU.

transformers 5.24 + accelerate 1.15 on the CPU: ``fp16=True`` makes no GradScaler and no autocast
(accelerate does fp16 only on accelerators), so the fp16 test hands accelerate the
``torch.amp.GradScaler("cpu")`` and autocast it would make on a GPU (``accelerator.scaler``,
``native_amp``) before ``train()``: the Trainer then runs the same code path as on a GPU (scale →
backward → unscale_ in its clip → callback → ``scaler.step`` → ``update``). The bf16 test runs the
Trainer's own CPU bf16 configuration unchanged; bf16 needs no scaler and nothing overflows in a few
steps, so the fault is injected (an Inf written into one gradient at step 3).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

from ampdoctor.cli.app import app  # noqa: E402
from ampdoctor.integrations.transformers import AmpDoctorCallback  # noqa: E402
from ampdoctor.watch.steplog_read import read_step_log  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> None:
    """accelerate keeps one process-wide state: a run with another mixed precision (an earlier test)
    would make this one's Accelerator refuse to start."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)

SPEC = '''
import torch
from transformers import BertConfig, BertForSequenceClassification

def build_model():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2))
'''
QUERY = "bert.encoder.layer.1.attention.self.query"


def _model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2))


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (16,), generator=g), "labels": torch.tensor(i % 2)}


def _trainer(tmp: Path, cb: AmpDoctorCallback, **args: object) -> Trainer:
    kw: dict[str, object] = dict(per_device_train_batch_size=8, max_steps=8, use_cpu=True, report_to=[], logging_steps=1,
                                 save_strategy="no", disable_tqdm=True, seed=0)
    kw.update(args)
    return Trainer(model=_model(), args=TrainingArguments(str(tmp / "trainer"), **kw), train_dataset=Data(),  # type: ignore[arg-type]
                   eval_dataset=Data(), callbacks=[cb])


def test_fp16_gradscaler_skip_is_logged_with_its_module_and_captured(tmp_path: Path) -> None:
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap", inject_inf_at=5, inject_param=f"{QUERY}.weight")
    tr = _trainer(tmp_path, cb, fp16=True, eval_strategy="steps", eval_steps=3,  # an evaluation mid-run stays out
                  max_grad_norm=0.25)  # (its norms are 0.17 to 0.46: some steps are clipped)
    tr.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # what accelerate makes on a GPU
    tr.accelerator.native_amp = True
    tr.train()
    log = read_step_log(tmp_path / "steps.csv").frame
    # one row per optimizer step of the Trainer, numbered as it numbers them: its global_step after the step
    assert log["step"].tolist() == list(range(1, tr.state.global_step + 1)) == list(range(1, 9))
    assert set(log["step_convention"]) == {"trainer_global_step"}
    theirs_at = {h["step"]: h for h in tr.state.log_history if "loss" in h}
    assert sorted(theirs_at) == log["step"].tolist()
    # pre-clip: the very norm the Trainer's clip returned and logged as grad_norm; post-clip: after its clip to 1.0
    ok = log[~log["skipped"].astype(bool)].set_index("step")
    assert [ok.loc[s, "grad_l2_pre_clip"] for s in ok.index] == [theirs_at[s]["grad_norm"] for s in ok.index]
    assert (ok["grad_l2_pre_clip"] > 0.25).any() and (ok["grad_l2_pre_clip"] < 0.25).any()  # the Trainer clipped some ...
    pre, post = ok["grad_l2_pre_clip"].to_numpy(), ok["grad_l2_post_clip"].to_numpy()
    assert np.allclose(post, np.minimum(pre, 0.25), rtol=1e-5)  # ... to min(norm, 0.25): torch's clip_coef
    row = log.set_index("step").loc[5]
    assert bool(row["skipped"]) and row["skip_reason"] == f"nonfinite_grad:{QUERY}"
    assert (row["scaler_scale"], float(row["scale_after"])) == (1024.0, 512.0)
    assert log["skipped"].sum() == 1  # the skip was real: the weights stayed finite and training went on
    assert np.isfinite(log["loss"]).all()
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    # the Trainer's logged losses are the step log's (mean over the step), step for step
    ours = log.set_index("step")["loss"]
    theirs = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert np.allclose(ours.to_numpy(), theirs, rtol=1e-3)
    # the capture: state before step 5, its batch; triage --from replays it (the Inf was injected: not reproduced)
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["step"], m["reason"], m["module"], m["precision"]) == (5, "nonfinite_grad", QUERY, "amp")
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    assert rep["verdict"]["cause"] == "not_reproduced", r.output
    assert rep["verdict"]["first_step"] == 5


def test_bf16_nonfinite_losses_the_trainer_hides_are_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap", inject_inf_at=3, inject_param=f"{QUERY}.weight")
    tr = _trainer(tmp_path, cb, bf16=True, max_steps=6)
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        tr.train()
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    # no GradScaler: the Trainer applied the Inf, the log says so and names the module
    assert not bool(log.loc[3, "skipped"]) and log.loc[3, "skip_reason"] == f"applied:nonfinite_grad:{QUERY}"
    assert log["skipped"].sum() == 0
    # from then on the weights are NaN and so is every loss; the Trainer's own log shows finite numbers
    assert np.isnan(log.loc[4:, "loss"]).all()
    theirs = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert np.isfinite(theirs).all()
    assert caplog.text.count("the Trainer's own log hides it") == 1  # said once, not at every NaN step
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["step"], m["precision"], m["skipped"]) == (3, "bf16", False)
    assert "snapshot.pt" in m["files"] and m["batch_steps"][-1] == 3


def test_callback_leaves_nothing_on_the_model(tmp_path: Path) -> None:
    cb = AmpDoctorCallback(log=None)
    tr = _trainer(tmp_path, cb, max_steps=2)
    tr.train()
    assert cb.monitor is not None and cb.monitor.step_num == 3  # the next row would be the Trainer's step 3
    assert not torch.nn.modules.module._global_forward_hooks  # the monitor's and the tap's hooks are gone


def test_an_old_log_stops_the_run_before_its_first_step(tmp_path: Path) -> None:
    from ampdoctor.watch.steplog import StepLogError

    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", max_norm=None)
    _trainer(tmp_path, cb, max_steps=2).train()
    before = (tmp_path / "steps.csv").read_text()
    tr = _trainer(tmp_path, AmpDoctorCallback(log=tmp_path / "steps.csv"), max_steps=2)
    with pytest.raises(StepLogError, match="already holds 2 step"):
        tr.train()  # a fresh run (global step 0) onto the last run's log
    assert tr.state.global_step == 0
    assert (tmp_path / "steps.csv").read_text() == before  # nothing of the old log lost
    assert not torch.nn.modules.module._global_forward_hooks


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_gradient_accumulation_rows_are_optimizer_steps_and_the_capture_replays(tmp_path: Path) -> None:
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap", inject_inf_at=2, inject_param=f"{QUERY}.weight")
    tr = _trainer(tmp_path, cb, fp16=True, gradient_accumulation_steps=2, max_steps=4)
    tr.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    tr.accelerator.native_amp = True
    tr.train()
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    assert log.index.tolist() == [1, 2, 3, 4] and log.loc[2, "skip_reason"] == f"nonfinite_grad:{QUERY}"
    theirs = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert np.allclose(log["loss"].to_numpy(), theirs, rtol=1e-3)  # the loss the Trainer logs for the step
    batches = torch.load(tmp_path / "cap" / "batches.pt", weights_only=True)
    assert len(batches[-1]["ampdoctor_micro_batches"]) == 2  # the step's two micro-batches, kept together
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("not_reproduced", 2), r.output


class _Reg(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.body(x)
        return {"loss": torch.nn.functional.mse_loss(out.float(), labels), "logits": out}


class _RegData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        if i == 21:  # one sample holds a NaN: the loss of its step is NaN, and so is every gradient
            x[2] = float("nan")
        return {"x": x, "labels": torch.randn(1, generator=g)}


def _fp16_run(tmp: Path, cb: AmpDoctorCallback | None) -> tuple[Trainer, dict[str, torch.Tensor]]:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    args = TrainingArguments(str(tmp / "trainer"), per_device_train_batch_size=8, max_steps=6, use_cpu=True, report_to=[],
                             logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, fp16=True)
    assert getattr(args.optim, "value", args.optim) == "adamw_torch_fused"  # the Trainer's default optimizer
    tr = Trainer(model=_Reg(), args=args, train_dataset=_RegData(), callbacks=[cb] if cb is not None else [])
    tr.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # what accelerate makes on a GPU
    tr.accelerator.native_amp = True
    tr.train()
    return tr, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def test_fused_adamw_nan_loss_step_is_skipped_and_the_run_is_the_run_without_the_callback(tmp_path: Path) -> None:
    """The Trainer's default fused AdamW skips only on found_inf == 1: the callback must never add to it."""
    tr_bare, bare = _fp16_run(tmp_path / "bare", None)
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap")
    tr, seen = _fp16_run(tmp_path / "seen", cb)
    assert all(torch.isfinite(v).all() for v in seen.values())  # the NaN step was skipped, not applied
    for k in bare:
        assert torch.equal(seen[k], bare[k]), k
    torch.testing.assert_close(tr.accelerator.scaler.state_dict(), tr_bare.accelerator.scaler.state_dict())
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    skipped = log.index[log["skipped"].astype(bool)].tolist()
    assert len(skipped) == 1 and log.loc[skipped[0], "skip_reason"] == "nonfinite_loss"
    assert np.isnan(log.loc[skipped[0], "loss"])
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert m["step"] == skipped[0] and m["skipped"] is True
    assert tr.optimizer.optimizer.defaults.get("fused") is True  # it ran fused
    # the pre-clip norm was read from the Trainer's own clip (max_grad_norm=1.0) while the run stayed the same
    theirs = {h["step"]: h["grad_norm"] for h in tr.state.log_history if "grad_norm" in h}
    ok = log[~log["skipped"].astype(bool)]
    assert len(ok) == 5 and all(ok.loc[s, "grad_l2_pre_clip"] == theirs[s] for s in ok.index)


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_a_trainer_run_prints_its_first_failure_without_logging_setup(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = f"""
import torch, transformers
from transformers import Trainer, TrainingArguments
from ampdoctor.integrations.transformers import AmpDoctorCallback
import tests.test_integration_trainer as t
args = TrainingArguments({str(tmp_path / "tr")!r}, per_device_train_batch_size=8, max_steps=4, use_cpu=True, report_to=[],
                         save_strategy="no", disable_tqdm=True, seed=0, bf16=True, logging_steps=1)
Trainer(model=t._Reg(), args=args, train_dataset=t._RegData(), callbacks=[AmpDoctorCallback(log=None)]).train()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    # bf16 on the CPU, no GradScaler: the Trainer applies the NaN step, and the callback says so, once
    assert r.stderr.count("ampdoctor: step 1 failed: the loss is nan; the step was applied") == 1, r.stderr[-3000:]
    assert r.stderr.count("the Trainer's own log hides it") == 1
    # one message for the event (issue 45): the hidden loss is said in the failure's own line, not a second message
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("ampdoctor: step 1 failed"))
    assert "the Trainer's own log hides it" in line and r.stderr.count("ampdoctor: step 1") == 1, r.stderr[-3000:]


def test_a_run_that_asked_for_fp16_and_runs_fp32_is_told_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # on the CPU accelerate makes no GradScaler and no autocast for fp16=True: the run is FP32
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap", inject_inf_at=1,
                           inject_param=f"{QUERY}.weight")
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        _trainer(tmp_path, cb, fp16=True, max_steps=3).train()
    said = [r.getMessage() for r in caplog.records if "was asked for" in r.getMessage()]
    assert said == ["ampdoctor: the Trainer (TrainingArguments) was asked for fp16 but runs fp32 (no GradScaler and no "
                    "FP16 autocast on this device); the step log and the capture describe what ran"]
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["precision"], m["monitor"]["asked_precision"], m["monitor"]["ran_precision"]) == ("fp32", "fp16", "fp32")
