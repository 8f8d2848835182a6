"""The one driver around the step recipe, the stage policies, the one forward+loss and the one rule for the
model's loss: tiny real models on the CPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.driver import NONFINITE_LOSS, NONFINITE_WEIGHTS, Driver, skip_reason, step_record
from ampdoctor.engine.forward import forward_loss, get_loss
from ampdoctor.engine.step import TrainStep
from ampdoctor.input.batches import UNKNOWN_TARGET, Micro
from ampdoctor.input.loss import model_loss
from ampdoctor.judge.detectors import kernel_limit
from ampdoctor.ladder import AMP, BF16, FP16_MASTER, FP32
from ampdoctor.report.build import stage_summary
from ampdoctor.report.stages import error_hint
from ampdoctor.watch.hooks import Hooks
from ampdoctor.watch.tap import output_loss

ROOT = Path(__file__).resolve().parents[1]


# the model's loss: one rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_one_element_tensor_of_any_shape_is_the_loss(shape: tuple[int, ...]) -> None:
    value = torch.full(shape, 2.5)
    for out in (value, {"loss": value, "logits": torch.ones(4)}):
        for loss in (model_loss(out), output_loss(out), get_loss(out, None, None), get_loss(out, UNKNOWN_TARGET, None)):
            assert loss is not None and loss.shape == () and float(loss) == 2.5


def test_several_elements_are_no_loss() -> None:
    logits = torch.ones(3)
    assert model_loss(logits) is None and output_loss(logits) is None and model_loss({"loss": torch.ones(2, 1)}) is None
    with pytest.raises(TypeError, match="scalar tensor, got \\(3,\\)"):
        get_loss(logits, None, None)
    with pytest.raises(TypeError, match="with no loss"):
        get_loss({"logits": logits}, None, None)
    # a captured forward whose output has no loss: the probe stands in (0, its gradients zero)
    assert float(get_loss(logits, UNKNOWN_TARGET, None)) == 0.0


def test_forward_loss_computes_in_the_policy() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    seen: list[torch.dtype] = []
    model.register_forward_hook(lambda m, a, out: seen.append(out.dtype))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out.float() - target) ** 2).mean()

    ref = forward_loss(model, (x, y), loss_fn)[1]
    assert seen[-1] == torch.float32
    out, loss = forward_loss(model, (x, y), loss_fn, BF16)
    assert seen[-1] == torch.bfloat16 and out.dtype == torch.bfloat16
    assert math.isclose(float(loss.detach()), float(ref.detach()), rel_tol=0.05)
    half = FP16_MASTER.cast_model(model)
    assert half is not model and next(half.parameters()).dtype == torch.float16
    assert next(model.parameters()).dtype == torch.float32 and FP32.cast_model(model) is model
    assert forward_loss(half, (x, y), loss_fn, FP16_MASTER)[0].dtype == torch.float16  # the inputs were cast


# the driver ---------------------------------------------------------------------------------------------------

def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def test_accumulated_step_is_the_plain_loop_over_its_micro_batches() -> None:
    """Two micro-batches through the driver: the loss logged is their sum (each divided by 2), the update the
    one a hand-written accumulation loop makes, and the record carries the measured figures."""
    torch.manual_seed(1)
    parts = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(2)]
    model, ref = _mlp(), _mlp()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    done = Driver(TrainStep(model, opt), _mse).step(0, Micro(parts), batch_index=7)
    ref_opt.zero_grad()
    total = 0.0
    for x, y in parts:
        loss = _mse(ref(x), y) / 2
        loss.backward()
        total += float(loss.detach())
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    rec = done.record
    assert (rec.step, rec.batch, rec.skipped, rec.skip_reason) == (0, 7, False, "")
    assert math.isclose(rec.loss, total, rel_tol=1e-6) and rec.lr == 0.1 and rec.scaler_scale is None
    assert rec.grad_l2_pre_clip > 0 and rec.grad_l2_pre_clip == rec.grad_l2_post_clip


def test_a_nonfinite_loss_stops_the_run_before_its_backward() -> None:
    """Without a GradScaler, stopping at non-finite losses: the step's record is skipped with reason
    nonfinite_loss and no norms, nothing was applied, and the run stops after it."""
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    hooks = Hooks(model)
    driver = Driver(TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks), _mse,
                    stop_at_nonfinite_loss=True, check_weights=True)
    batches = [(torch.randn(4, 4), torch.randn(4, 1)), (torch.full((4, 4), math.inf), torch.randn(4, 1)),
               (torch.randn(4, 4), torch.randn(4, 1))]
    with hooks:
        done = list(driver.steps(3, batches.__getitem__, before=lambda s: None))
    assert [d.record.step for d in done] == [0, 1] and driver.stop == NONFINITE_LOSS and driver.at == 1
    bad = done[1].record
    assert bad.skipped and bad.skip_reason == "nonfinite_loss" and math.isnan(bad.grad_l2_pre_clip) and not math.isfinite(bad.loss)
    assert done[1].measured is None and done[1].stats is not None  # its forward's statistics
    assert done[0].record.params_finite and not any(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())  # no NaN was back-propagated


def test_weights_gone_nonfinite_stop_the_run() -> None:
    """A plain loop (no GradScaler, applying what it gets) whose loss and gradients overflow: the step is
    applied, logged applied:<reason>, the weights are non-finite and the run stops."""
    model = _mlp()
    driver = Driver(TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_nonfinite=False), _mse,
                    check_weights=True)
    batches = [(torch.full((4, 4), 1e30), torch.zeros(4, 1))] * 3
    done = list(driver.steps(3, batches.__getitem__))
    rec = done[-1].record
    assert len(done) == 1 and driver.stop == NONFINITE_WEIGHTS and not rec.params_finite
    assert not rec.skipped and rec.skip_reason == "applied:nonfinite_loss"


def test_skip_reason_and_record_of_a_skipped_amp_step() -> None:
    """With a GradScaler a gradient overflow is skipped: the reason names the module, and the record built from the
    same measurement says the scale backs off."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    driver = Driver(TrainStep(model, opt, scaler, precision=AMP), _mse)
    driver.begin(0)
    assert driver.accumulate((torch.full((4, 4), 1e4), torch.zeros(4, 1))) is None
    m, _ = driver.measure()
    driver.apply(m)
    assert m.skip and driver.skipped(m) and skip_reason(m, True).startswith("nonfinite_grad")
    assert skip_reason(m, False) == f"applied:{m.reason}"
    rec = step_record(0, m, skipped=True, batch=3)
    assert rec.skipped and rec.skip_reason == m.reason and rec.scaler_scale == 2.0**16
    assert rec.scale_after == 2.0**15 and rec.nonfinite_count == m.bad_count >= 1 and rec.batch == 3
    assert scaler.get_scale() == 2.0**15  # what the record foretold
    assert step_record(0, m, skipped=True, reason="skipped_by_caller", skip_rate=0.5).skip_rate == 0.5


# the dump's repro script ------------------------------------------------------------------------------------

SUBSET_SPEC = '''
import torch
from torch import nn


class Model(nn.Module):
    """Takes two of the batch's four keys: the others are fields of the dataset the model never sees."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": ((self.body(x) - labels) ** 2).mean()}


def build_model():
    return Model()


def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(8, 4, generator=g), "labels": torch.randn(8, 1, generator=g),
             "sample_id": torch.arange(8), "weight": torch.ones(8)} for _ in range(2)]
'''


def test_repro_script_runs_a_model_that_takes_a_subset_of_the_batch_keys(tmp_path: Path) -> None:
    """The generated repro.py runs forward and loss the way the stages do: keys the forward does not take
    are left out (``filter_kwargs``), in FP32 and in the failing stage's precision."""
    spec = tmp_path / "subset.py"
    spec.write_text(SUBSET_SPEC)
    dump = tmp_path / "dump"
    res = CliRunner().invoke(app, ["triage", str(spec), "--steps", "2", "--device", "cpu", "--dump-dir", str(dump), "-q"])
    assert res.exit_code in (0, 1), res.output
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(dump / "repro.py"), "cpu"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln.split(":")[0].strip() for ln in out.stdout.splitlines() if "gradients finite" in ln]
    assert lines[0] == "fp32" and len(lines) >= 1
    assert "gradients finite: True" in out.stdout


# the stages' codes, and their words at the report's edge -----------------------------------------------------

def test_a_stage_error_hint_says_what_its_kind_is() -> None:
    """The hint a stage's exception gets follows the kernel the device lacks (``detectors.kernel_limit``, from torch's
    message): a device limitation is said to be one, anything else is to be fixed."""
    onednn = "could not create a primitive descriptor for a matmul primitive"
    assert "oneDNN" in error_hint(kernel_limit(onednn, "amp", "cpu")) and "not a NaN cause" in error_hint("onednn_fp16")
    assert error_hint(kernel_limit(onednn, "fp32", "cpu")).startswith("the stage stopped at this exception")
    assert "device limitation" in error_hint(kernel_limit("\"addmm_impl_cpu_\" not implemented for 'Half'", "fp32", "cpu"))
    assert error_hint(kernel_limit("shapes do not match", "amp", "cpu")) == error_hint(None)


def test_a_stage_that_stopped_is_a_code_and_a_sentence_in_the_report() -> None:
    """A model whose loss goes NaN at step 1 without a GradScaler stops its fp32 stage there: the engine records
    the code, the report's line of the stage words it in the run's steps."""
    from ampdoctor.engine.stages import StageContext, run_stage
    from ampdoctor.input.batches import Batches
    from ampdoctor.input.config import TriageConfig
    from ampdoctor.input.spec import Spec

    model = _mlp()
    batches = Batches([(torch.randn(4, 4), torch.randn(4, 1)), (torch.full((4, 4), math.nan), torch.randn(4, 1))], cycled=True)
    spec = Spec(Path("inline.py"), _mlp, lambda: batches.items, _mse, None)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    res = run_stage("fp32", StageContext(spec, model, init, batches, TriageConfig(steps=4, device="cpu"), torch.device("cpu")))
    assert res.error is None and len(res.records) == 2 and res.stopped == NONFINITE_LOSS
    assert res.records[1].skip_reason == "nonfinite_loss" and res.records[1].batch == 1
    row = stage_summary(res, None, 100)
    assert row.stopped == "loss became non-finite at step 101" and row.steps_run == 2
