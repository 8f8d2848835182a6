"""Loops people really have (issue 13 item 3): optimizers built from the model or its named
parameters, an LR scheduler, gradient accumulation, updates by hand, and `layers --max-norm`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor import Monitor, TriageConfig, layer_stats, triage
from ampdoctor.cli.app import app
from ampdoctor.errors import UsageError

BASE = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))

def build_dataloader():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    xs = [torch.randn(16, 8, generator=g) for _ in range(12)]
    return [(x, x @ w) for x in xs]

def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)
'''


def spec(tmp_path: Path, extra: str) -> Path:
    p = tmp_path / "spec.py"
    p.write_text(BASE + extra)
    return p


def test_build_optimizer_may_take_the_model_for_decay_groups(tmp_path: Path) -> None:
    extra = '''
def build_optimizer(model):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
'''
    report, run = triage(spec(tmp_path, extra), TriageConfig(steps=10))
    assert report.verdict.cause == "healthy"
    assert {s.name: s.steps_run for s in report.stages} == {"fp32": 10, "fp16": 10, "amp": 10}


def test_build_optimizer_may_take_named_parameters(tmp_path: Path) -> None:
    extra = '''
def build_optimizer(named_parameters):
    named = list(named_parameters)
    assert all(isinstance(n, str) for n, _ in named)
    return torch.optim.SGD([p for _, p in named], lr=0.05)
'''
    report, _ = triage(spec(tmp_path, extra), TriageConfig(steps=6))
    assert report.verdict.cause == "healthy"


def test_build_scheduler_steps_after_every_optimizer_step(tmp_path: Path) -> None:
    extra = '''
def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def build_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
'''
    _, run = triage(spec(tmp_path, extra), TriageConfig(steps=4))
    for name in ("fp32", "amp"):
        assert [r.lr for r in run.results[name].records] == pytest.approx([0.1, 0.05, 0.025, 0.0125]), name


def test_accumulate_runs_n_micro_batches_a_step_and_logs_the_full_loss(tmp_path: Path) -> None:
    p = spec(tmp_path, "")
    _, one = triage(p, TriageConfig(steps=1, stages=("fp32",)))
    _, acc = triage(p, TriageConfig(steps=3, accumulate=2, stages=("fp32",)))
    recs = acc.results["fp32"].records
    assert len(recs) == 3 and len(acc.batches.items) == 3 and all(len(g) == 2 for g in acc.batches.items)
    # step 0 from the same initial weights: the mean of micro-batches 0 and 1's losses
    import importlib.util
    spec_ = importlib.util.spec_from_file_location("s", p)
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    model, data = mod.build_model(), mod.build_dataloader()
    with torch.no_grad():
        want = sum(float(mod.loss_fn(model(x), y)) for x, y in data[:2]) / 2
    assert recs[0].loss == pytest.approx(want, rel=1e-5)
    assert one.results["fp32"].records[0].loss != pytest.approx(want, rel=1e-5)
    res = CliRunner().invoke(app, ["triage", str(p), "--steps", "3", "--accumulate", "2", "-q"])
    assert res.exit_code == 0, res.output


def test_monitor_accumulation_logs_the_sum_of_the_micro_batch_losses() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    xs = [torch.randn(8, 4) for _ in range(3)]
    with Monitor(model, opt, scaler, activations=False) as mon:
        parts = []
        for x in xs:
            with mon.autocast():
                loss = model(x).float().pow(2).mean() / len(xs)
            parts.append(float(loss.detach()))
            mon.backward(loss)
        rec = mon.step()
    assert rec.loss == pytest.approx(sum(parts), rel=1e-6) and not rec.skipped


def test_monitor_without_optimizer_for_updates_by_hand() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    w0 = model.weight.detach().clone()
    mon = Monitor(model, None, activations=False)
    for _ in range(2):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        mon.after_backward(loss)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        rec = mon.after_step()
    assert rec.step == 1 and rec.grad_l2_pre_clip > 0 and not torch.equal(model.weight, w0)
    with pytest.raises(UsageError, match="without an optimizer"):
        mon.step(model(torch.randn(8, 4)).pow(2).mean())
    mon.close()
    with pytest.raises(UsageError, match="GradScaler needs the optimizer"):
        Monitor(model, None, torch.amp.GradScaler("cpu"))


def test_layers_max_norm_clips_the_reference_steps_like_triage() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    batches = [(torch.randn(16, 8) * 10, torch.randn(16, 1) * 100) for _ in range(2)]
    free = layer_stats(model, batches, "fp16", steps=2, loss_fn=nn.functional.mse_loss, what="grads")
    clipped = layer_stats(model, batches, "fp16", steps=2, loss_fn=nn.functional.mse_loss, what="grads", max_norm=1e-3)
    pg = clipped[clipped.kind == "param_grad"]
    assert free[free.kind == "param_grad"].absmax.max() > 1e-2
    assert (pg.absmax <= 1e-3 * (1 + 1e-5)).all()
    with pytest.raises(UsageError):
        layer_stats(model, batches, "fp16", steps=1, loss_fn=nn.functional.mse_loss, max_norm=0.0)


def test_plain_loop_without_scaler_is_logged_as_it_ran(tmp_path: Path) -> None:
    """No GradScaler: a loop that never reads should_skip applies every step, and the log says so; a loop
    that reads it and skips is logged as skipping."""
    from ampdoctor import Monitor

    for asks in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Monitor(model, opt, log=tmp_path / f"asks{asks}.csv") as mon:
            for step in range(4):
                x = torch.ones(2, 4) * (float("inf") if step == 2 else 1.0)
                loss = model(x).pow(2).mean()
                loss.backward()
                mon.after_backward(loss)
                if not (asks and mon.should_skip):
                    opt.step()
                rec = mon.after_step()
                opt.zero_grad()
                if step == 2:
                    assert rec.skipped is asks
                    assert rec.skip_reason == ("nonfinite_loss" if asks else "applied:nonfinite_loss")
        assert all(torch.isfinite(p).all() for p in model.parameters()) is asks
    r = CliRunner().invoke(app, ["scaler", str(tmp_path / "asksFalse.csv")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "0 of 4 steps" in r.output
    assert "2 step(s) applied a non-finite update" in " ".join(r.output.split())  # step 2, and step 3 from its NaN weights
