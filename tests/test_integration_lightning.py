"""Lightning with ``AmpDoctorCallback``: a tiny LightningModule trained for real on the CPU.

Lightning 2.6 turns ``precision="16-mixed"`` on the CPU into bf16 (it says so in a warning), so the
fp16 test passes Lightning's own ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))``
plugin, the one it builds for "16-mixed" on a GPU: the same hooks, ``unscale_`` and ``scaler.step``.
The bf16 test runs ``precision="16-mixed"`` as Lightning configures it on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

from ampdoctor.cli.app import app  # noqa: E402
from ampdoctor.integrations.lightning import AmpDoctorCallback  # noqa: E402
from ampdoctor.watch.steplog_read import read_step_log  # noqa: E402

SPEC = '''
import torch
from torch import nn
import lightning as L

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(self.embed(x))

    def training_step(self, batch, i):
        x, y = batch
        return loss_fn(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float(), y)

def build_model():
    return Net()
'''


def _module(tmp: Path) -> tuple[object, Path]:
    spec = tmp / "spec.py"
    spec.write_text(SPEC)
    ns: dict[str, object] = {}
    exec(compile(SPEC, str(spec), "exec"), ns)
    return ns["build_model"](), spec  # type: ignore[operator]


def _data(bad_step: int | None = None, n: int = 64) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
    if bad_step is not None:
        xs[8 * bad_step + 2, 3] = float("inf")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8)


def _trainer(cb: AmpDoctorCallback | None, **kw: object) -> L.Trainer:
    args: dict[str, object] = dict(accelerator="cpu", max_steps=8, callbacks=[cb] if cb is not None else [], logger=False, enable_checkpointing=False,
                                   enable_progress_bar=False, enable_model_summary=False)
    args.update(kw)
    return L.Trainer(**args)


def test_16_mixed_skip_logged_and_captured(tmp_path: Path) -> None:
    net, spec = _module(tmp_path)
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    tr = _trainer(cb, plugins=[plugin])
    tr.fit(net, _data(bad_step=5))
    log = read_step_log(tmp_path / "steps.csv").frame
    assert log["step"].tolist() == list(range(tr.global_step)) == list(range(8))
    row = log.set_index("step").loc[5]
    assert bool(row["skipped"]) and row["skip_reason"] == "nonfinite_loss" and np.isnan(row["loss"])
    assert (row["scaler_scale"], float(row["scale_after"])) == (1024.0, 512.0)
    assert log["skipped"].sum() == 1 and all(torch.isfinite(p).all() for p in net.parameters())  # type: ignore[attr-defined]
    # the loss is the training_step's (Lightning scales it before on_before_backward; the log does not)
    assert 1.0 < log.loc[0, "loss"] < 2.0
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["step"], m["reason"], m["precision"], m["batch_steps"][-1]) == (5, "nonfinite_loss", "amp", 5)
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 5), r.output


def test_bf16_on_the_cpu_applies_the_nan_and_the_log_says_so(tmp_path: Path) -> None:
    net, _ = _module(tmp_path)
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv")
    with pytest.warns(UserWarning, match="Using `precision='bf16-mixed'` instead"):
        tr = _trainer(cb, precision="16-mixed")
    tr.fit(net, _data(bad_step=3))
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    assert log.loc[3, "skip_reason"] == "applied:nonfinite_loss" and not bool(log.loc[3, "skipped"])
    assert np.isfinite(log.loc[:2, "loss"]).all() and np.isnan(log.loc[4:, "loss"]).all()
    assert cb.monitor.amp_dtype == torch.bfloat16


def test_gradient_accumulation_logs_optimizer_steps(tmp_path: Path) -> None:
    net, _ = _module(tmp_path)
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    tr = _trainer(cb, plugins=[plugin], accumulate_grad_batches=2, max_steps=4)
    tr.fit(net, _data(bad_step=5))  # batch 5 is the second micro-batch of optimizer step 2
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    assert log.index.tolist() == [0, 1, 2, 3]
    assert log.loc[2, "skip_reason"] == "nonfinite_loss" and log["skipped"].sum() == 1
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert m["step"] == 2
    batches = torch.load(tmp_path / "cap" / "batches.pt", weights_only=True)
    assert len(batches[-1]["ampdoctor_micro_batches"]) == 2  # the step's two micro-batches, kept together


def test_injected_inf_is_a_skip_naming_the_module(tmp_path: Path) -> None:
    net, _ = _module(tmp_path)
    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", inject_inf_at=4, inject_param="body.0.weight")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    _trainer(cb, plugins=[plugin], max_steps=6).fit(net, _data())
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    # the Inf lands after Lightning's unscale_: the monitor adds it to GradScaler's found-inf, which skips
    assert bool(log.loc[4, "skipped"]) and log.loc[4, "skip_reason"] == "nonfinite_grad:body.0"
    assert log.loc[4, "injected"] == "inf:body.0.weight" and float(log.loc[4, "scale_after"]) == 512.0
    assert log["skipped"].sum() == 1 and all(torch.isfinite(p).all() for p in net.parameters())  # type: ignore[attr-defined]


def test_fused_adamw_with_and_without_the_callback_ends_bit_identical(tmp_path: Path) -> None:
    """AdamW(fused=True) skips only on found_inf == 1: the callback observes and writes nothing."""

    def run(with_cb: bool) -> list[torch.Tensor]:
        net, _ = _module(tmp_path)
        net.configure_optimizers = lambda: torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)  # type: ignore[attr-defined]
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
        cbs = [AmpDoctorCallback(log=tmp_path / f"steps{int(with_cb)}.csv", capture=tmp_path / "cap")] if with_cb else []
        L.seed_everything(0, verbose=False)
        L.Trainer(accelerator="cpu", max_steps=8, callbacks=cbs, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, plugins=[plugin],
                  ).fit(net, _data(bad_step=3))
        return [p.detach().clone() for p in net.parameters()]  # type: ignore[attr-defined]  # (no clip: Lightning refuses it with a fused optimizer, which unscales inside its step)

    bare, seen = run(False), run(True)
    assert all(torch.isfinite(p).all() for p in seen)  # the NaN step was skipped, not applied
    assert all(torch.equal(a, b) for a, b in zip(bare, seen, strict=True))
    log = read_step_log(tmp_path / "steps1.csv").frame.set_index("step")
    assert log["skipped"].sum() == 1 and log.loc[3, "skip_reason"] == "nonfinite_loss"


def _logged(net: object) -> object:
    """The module, its training_step also logging the loss (what a CSVLogger writes, at Lightning's step)."""
    plain = net.training_step  # type: ignore[attr-defined]

    def training_step(batch: object, batch_idx: int) -> torch.Tensor:
        loss = plain(batch, batch_idx)
        net.log("train_loss", loss, on_step=True, on_epoch=False)  # type: ignore[attr-defined]
        return loss  # type: ignore[no-any-return]

    net.training_step = training_step  # type: ignore[attr-defined]
    return net


def _big_data(n: int = 64) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
    xs[n // 2:] *= 6.0  # gradient norms of 3 to 5 in the last four batches, below 1 in the first four
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8)


def test_gradient_clip_val_logs_the_norm_before_and_after_lightnings_clip_at_csvloggers_steps(tmp_path: Path) -> None:
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    net = _logged(_module(tmp_path)[0])
    before: dict[int, float] = {}

    class Probe(L.Callback):  # type: ignore[misc]
        """Lightning's own hook before its clip: the norm its clip_grad_norm_ is about to compute."""

        def on_before_optimizer_step(self, trainer: object, pl_module: object, optimizer: torch.optim.Optimizer) -> None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            before[trainer.global_step] = float(torch.nn.utils.get_total_norm(grads))  # type: ignore[attr-defined]

    cb = AmpDoctorCallback(log=tmp_path / "steps.csv")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    tr = _trainer(cb, plugins=[plugin], gradient_clip_val=1.0, callbacks=[Probe(), cb], log_every_n_steps=1,
                  logger=CSVLogger(str(tmp_path), name="csv", version=0))
    tr.fit(net, _big_data())
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    theirs = pd.read_csv(tmp_path / "csv" / "version_0" / "metrics.csv").dropna(subset=["train_loss"]).set_index("step")
    # the step numbers are the CSVLogger's, step for step, and so are the losses
    assert log.index.tolist() == theirs.index.tolist() == sorted(before) == list(range(8))
    assert set(log["step_convention"]) == {"lightning_global_step"}
    assert np.allclose(log["loss"].to_numpy(), theirs["train_loss"].to_numpy(), rtol=1e-6)
    # pre-clip: the norm Lightning's clip_grad_norm_ returned (bit for bit the norm before it); post-clip: after it
    pre, post = log["grad_l2_pre_clip"].to_numpy(), log["grad_l2_post_clip"].to_numpy()
    assert pre.tolist() == [before[s] for s in log.index]
    assert (pre > 1.0).sum() >= 2 and (pre < 1.0).sum() >= 1, pre  # clipped steps and an unclipped one
    assert np.allclose(post, np.minimum(pre, 1.0), rtol=1e-5) and (post < pre).sum() == (pre > 1.0).sum()
    assert "_clip_gradients" not in vars(tr.precision_plugin)  # unwrapped at the end of training


def test_clipping_with_and_without_the_callback_ends_bit_identical(tmp_path: Path) -> None:
    """gradient_clip_val: the callback measures after Lightning's clip and reads its clip_grad_norm_'s return value;
    the weights and the scaler end as without it (a NaN step included)."""

    def run(with_cb: bool) -> tuple[list[torch.Tensor], dict[str, object]]:
        net, _ = _module(tmp_path)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
        cbs = [AmpDoctorCallback(log=tmp_path / f"clip{int(with_cb)}.csv", capture=tmp_path / "clipcap")] if with_cb else []
        L.seed_everything(0, verbose=False)
        _trainer(None, callbacks=cbs, plugins=[plugin], gradient_clip_val=0.5).fit(net, _data(bad_step=3))  # type: ignore[arg-type]
        return [p.detach().clone() for p in net.parameters()], dict(plugin.scaler.state_dict())  # type: ignore[attr-defined,union-attr]

    (bare, s0), (seen, s1) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(bare, seen, strict=True)) and s0 == s1
    log = read_step_log(tmp_path / "clip1.csv").frame.set_index("step")
    assert log.loc[3, "skip_reason"] == "nonfinite_loss" and log["skipped"].sum() == 1
    ok = log[~log["skipped"].astype(bool)]
    assert (ok["grad_l2_post_clip"] < ok["grad_l2_pre_clip"]).any() and (ok["grad_l2_post_clip"] <= 0.5 + 1e-5).all()
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"  # the observer is gone with the monitor


DATA_SPEC = '''
from tests.test_integration_lightning import _data

def build_dataloader():
    return _data(bad_step=5)
'''


def test_a_lightning_run_replays_without_a_spec_from_its_capture_and_its_ckpt(tmp_path: Path) -> None:
    """No build_model, no loss_fn, no build_optimizer: the LightningModule from its import path and hparams, its
    training_step as the loss, and (from the .ckpt) its configure_optimizers' two groups."""
    from tests.lightning_models import LitNet

    class Save(L.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            if trainer.global_step == 5:  # after the steps 0-4: the next step is the CSVLogger's step 5
                trainer.save_checkpoint(tmp_path / "step5.ckpt")

    cb = AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap", quiet=True)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    _trainer(cb, plugins=[plugin], callbacks=[cb, Save()]).fit(LitNet(hidden=24), _data(bad_step=5))
    r = CliRunner().invoke(app, ["triage", "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 5), r.output
    assert any("LightningModule LitNet(hidden, lr) from tests.lightning_models.LitNet" in n and "training_step" in n
               for n in rep["notes"]), rep["notes"]
    # the .ckpt: AmpDoctorCallback's state names the class; the hparams are Lightning's own hyper_parameters
    ck = torch.load(tmp_path / "step5.ckpt", weights_only=True)
    assert ck["callbacks"]["AmpDoctorCallback"]["model_identity"]["class"] == "tests.lightning_models.LitNet"
    spec = tmp_path / "data.py"
    spec.write_text(DATA_SPEC)
    r = CliRunner().invoke(app, ["triage", str(spec), "--checkpoint", str(tmp_path / "step5.ckpt"), "--skip-batches", "5",
                                 "--steps", "2", "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 5), r.output
    notes = " | ".join(rep["notes"])
    assert "LitNet(hidden, lr)" in notes and "hparams step5.ckpt (AmpDoctorCallback's state) recorded" in notes, notes
    assert "2 parameter group(s) ([3, 3]) come from LitNet.configure_optimizers()" in notes, notes
    assert "LitNet.training_step" in notes, notes
