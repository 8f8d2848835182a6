"""Issue 12's rules as pure functions, on synthetic records and on tiny real models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor.input.batches import Batches
from ampdoctor.judge import locate
from ampdoctor.judge.datascan import scan_batches
from ampdoctor.judge.detectors import custom_function_dtype, frozen_params, loss_fault, probe_on_flagged_batch
from ampdoctor.judge.opscan import first_nonfinite_op
from ampdoctor.records import NCOLS, Call, Col, StageError, StageResult, StepRecord, StepStats
from ampdoctor.watch.blame import GraphRecorder
from ampdoctor.watch.hooks import Hooks


def _row(numel: int = 4, nonfinite: int = 0) -> np.ndarray:
    r = np.zeros(NCOLS)
    r[Col.NUMEL] = numel
    r[Col.NAN] = nonfinite
    r[Col.NORMAL] = numel - nonfinite
    return r


def _rec(step: int, loss: float) -> StepRecord:
    return StepRecord(step, step, 1e-3, loss, 1.0, 1.0, False, "", None)


# loss_fault -------------------------------------------------------------------------------------
def _fwd_stats(bad_output: bool) -> StepStats:
    st = StepStats(0, calls=[Call("0", [0], [1]), Call("<model>", [0], [1])])
    st.act = {0: _row(), 1: _row(nonfinite=1 if bad_output else 0)}
    return st


def test_loss_fault_when_outputs_are_finite_and_the_loss_is_not() -> None:
    res = StageResult("amp", records=[_rec(0, float("inf"))], stats=[_fwd_stats(False)])
    lf = loss_fault(res, 0, res.stats[0])
    assert lf is not None and lf.step == 0 and lf.loss == float("inf")


@pytest.mark.parametrize(("loss", "bad_output"), [(1.0, False), (float("nan"), True)])
def test_no_loss_fault_for_a_finite_loss_or_a_module_fault(loss: float, bad_output: bool) -> None:
    res = StageResult("amp", records=[_rec(0, loss)], stats=[_fwd_stats(bad_output)])
    assert loss_fault(res, 0, res.stats[0]) is None


# frozen_params ----------------------------------------------------------------------------------
def _moved(stage: str, moved: dict[str, float], n: int = 10, stopped: str | None = None) -> StageResult:
    return StageResult(stage, records=[_rec(i, 1.0) for i in range(n)], moved=moved, stopped=stopped)


def test_frozen_needs_flushed_gradients_and_weights_that_lag_fp32() -> None:
    fp32 = _moved("fp32", {"a.w": 1.0, "b.w": 1.0, "c.w": 1.0})
    tgt = _moved("fp16", {"a.w": 0.0, "b.w": 0.49, "c.w": 0.51})
    fz = frozen_params(tgt, fp32, [("a.w", 1.0), ("b.w", 0.9), ("c.w", 0.9)])
    assert [(f.param, f.module, f.moved) for f in fz] == [("a.w", "a", 0.0), ("b.w", "b", 0.49)]
    # a parameter that moves but is not flushed is not frozen: the rule needs both
    assert frozen_params(tgt, fp32, []) == []


def test_frozen_is_not_judged_on_a_stage_that_stopped_or_ran_fewer_steps() -> None:
    fp32 = _moved("fp32", {"a.w": 1.0})
    assert frozen_params(_moved("fp16", {"a.w": 0.0}, stopped="weights became non-finite"), fp32, [("a.w", 1.0)]) == []
    assert frozen_params(_moved("fp16", {"a.w": 0.0}, n=5), fp32, [("a.w", 1.0)]) == []
    # FP32 itself did not move the parameter: nothing to compare against
    assert frozen_params(_moved("fp16", {"a.w": 0.0}), _moved("fp32", {"a.w": 0.0}), [("a.w", 1.0)]) == []


# custom_function_dtype --------------------------------------------------------------------------
def test_custom_function_dtype_error() -> None:
    e = StageError("RuntimeError", "expected m1 and m2 to have the same dtype, but got: c10::Half != float", 0, "proj", "", "MatMul")
    cf = custom_function_dtype(e)
    assert cf is not None and (cf.function, cf.module) == ("MatMul", "proj")
    assert custom_function_dtype(StageError("RuntimeError", e.message, 0, "proj", "")) is None  # not a custom Function
    assert custom_function_dtype(StageError("ValueError", "bad shape", 0, "proj", "", "MatMul")) is None  # not a dtype error


# entry_child (never answer <model> in backward) -------------------------------------------------
def test_entry_child_is_the_first_child_reached_whose_output_gets_a_nonfinite_gradient() -> None:
    st = StepStats(0, calls=[Call("body", [0], [1]), Call("mu", [1], [2]), Call("var", [1], [3]), Call("<model>", [0], [4])])
    st.model_outputs = [4]
    st.grad = {4: _row(nonfinite=1), 3: _row(nonfinite=1), 2: _row(), 1: _row(nonfinite=1)}
    st.grad_order = [4, 3, 2, 1]
    assert locate.entry_child(st) == "var"
    assert locate.locate_backward(st) == "var"


# probe_on_flagged_batch -------------------------------------------------------------------------
def test_probe_failure_follows_only_data_no_earlier_batch_held() -> None:
    items = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    items[2][0][1, 1] = 1e6  # outlier, only in batch 2
    for b in items:
        b[1][0, 0] = -999999.0  # a sentinel in every batch
    issues = scan_batches(Batches(items, cycled=False))
    kinds = {d.kind for d in probe_on_flagged_batch(2, lambda s: s, issues)}
    assert kinds == {"outlier"}  # the sentinel was in batches 0 and 1 too, and the probe got through them
    assert probe_on_flagged_batch(0, lambda s: s, issues)[0].kind == "sentinel"
    assert probe_on_flagged_batch(1, lambda s: s, issues) == []


# scan_batches -----------------------------------------------------------------------------------
def test_scan_finds_each_kind_with_batch_field_samples_and_value() -> None:
    g = torch.Generator().manual_seed(0)
    items = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]
    items[1][1][2, 0] = float("nan")
    items[2][0][3, 1] = 9.97e36
    items[4][0][5, 0] = 9.97e36
    items[3][0][1, 2] = 5e3
    items[5][1][6, 0] = 7e4 * 0 + 70000.0  # beyond FP16, but targets' typical magnitude is ~0.6: an outlier
    by = {(d.kind, d.field): d for d in scan_batches(Batches(items, cycled=False))}
    assert set(by) == {("nonfinite", "targets"), ("sentinel", "inputs"), ("outlier", "inputs"), ("outlier", "targets")}
    s = by[("sentinel", "inputs")]
    assert (s.batches, s.samples, s.count, s.value) == ((2, 4), (3,), 2, pytest.approx(9.97e36, rel=1e-6))
    o = by[("outlier", "inputs")]
    assert (o.batches, o.samples, o.value) == ((3,), (1,), 5e3) and 0.3 < o.typical < 1.0
    assert by[("nonfinite", "targets")].samples == (2,)


def test_scan_beyond_fp16_without_being_an_outlier() -> None:
    items = [(torch.full((4, 2), 1e5) + torch.arange(8.0).reshape(4, 2), torch.zeros(4, 1)) for _ in range(3)]
    ds = scan_batches(Batches(items, cycled=False))
    assert [(d.kind, d.field, d.batches) for d in ds] == [("beyond_fp16", "inputs", (i,)) for i in range(3)]


def test_scan_is_quiet_on_ordinary_data() -> None:
    g = torch.Generator().manual_seed(0)
    items = [{"x": torch.randn(16, 8, generator=g), "labels": (torch.rand(16, generator=g) > 0.5).float(),
              "ids": torch.randint(0, 9, (16,), generator=g)} for _ in range(5)]
    assert scan_batches(Batches(items, cycled=False)) == []


# first_nonfinite_op -----------------------------------------------------------------------------
class _Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        return h.mul_(1e30).mul_(1e30)  # in place: its input is checked before it runs


def test_first_nonfinite_op_names_the_root_op_and_its_line() -> None:
    torch.manual_seed(0)
    m = _Root()
    op = first_nonfinite_op(m, lambda: m(torch.ones(2, 4)))
    assert op is not None and op.op == "mul_" and op.module == locate.MODEL
    assert op.line is not None and op.line.startswith("test_rules_extra.py:")


def test_first_nonfinite_op_outside_the_model_is_the_loss() -> None:
    m = nn.Linear(4, 1)

    def run() -> None:
        p = torch.sigmoid(m(torch.ones(2, 4)) * 0 + 20).half()  # rounds to exactly 1.0 in FP16
        torch.log(1 - p).mean()

    op = first_nonfinite_op(m, run)
    assert op is not None and (op.op, op.module) == ("log", None)


# GraphRecorder ----------------------------------------------------------------------------------
class _Bad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x * 2

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        raise RuntimeError("expected scalar type Float but found Half")


class _Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Bad.apply(x) + 1


def test_graph_recorder_names_the_innermost_module_whose_node_raised() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), _Inner()), nn.Linear(4, 1))
    rec = GraphRecorder(model)
    try:
        y = model(torch.randn(2, 4))
        with pytest.raises(RuntimeError) as ei:
            y.sum().backward()
        b = rec.blame(ei.value)
        assert b is not None and (b.module, b.custom_function, b.node) == ("1.1", "_Bad", "_BadBackward")
    finally:
        rec.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_hooks_see_no_difference_with_the_recorder() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    rec = GraphRecorder(model)
    x = torch.randn(3, 4)
    with Hooks(model) as h:
        h.begin_step(0)
        y = model(x)
        assert torch.equal(y, model[2](model[1](model[0](x))))
        h.end_step()
    rec.remove()
