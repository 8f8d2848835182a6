"""The precision ladder: every stage a user can ask for is a registered rung, each rung says what it computes,
and the triage runs the rungs of ``ladder(config)`` in order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampdoctor.input.config import STAGES, TriageConfig
from ampdoctor.ladder import AMP, BF16, FP16_MASTER, FP16_PURE, FP32, NONE, Rung, ladder, register, registered, rung


def test_every_stage_a_user_can_ask_for_is_a_registered_rung() -> None:
    assert set(STAGES) <= set(registered())
    for name in STAGES:
        assert rung(name).name == name


def test_the_builtin_rungs_are_the_stage_policies() -> None:
    assert rung("fp32") is FP32 and rung("amp") is AMP and rung("bf16") is BF16
    assert rung("fp16") is FP16_MASTER and rung("fp16", TriageConfig(target="fp16")) is FP16_PURE
    assert AMP.compute == torch.float16 and AMP.scaler and BF16.compute == torch.bfloat16 and not BF16.scaler
    assert FP16_MASTER.params == torch.float16 and FP16_MASTER.master and not FP16_PURE.master
    assert all(r.transform is NONE for r in (FP32, FP16_MASTER, FP16_PURE, AMP, BF16))
    with pytest.raises(ValueError, match="unknown stage 'fp4'; the stages are fp32, fp16, amp, bf16"):
        rung("fp4")
    mon = Rung.for_autocast(torch.bfloat16, False)
    assert (mon.name, mon.compute, mon.params, mon.scaler) == ("bf16", torch.bfloat16, torch.float32, False)


def test_the_ladder_is_the_configs_stages_in_order_fp32_first() -> None:
    assert [r.name for r in ladder(TriageConfig())] == ["fp32", "fp16", "amp"]
    assert ladder(TriageConfig(target="bf16")) == [FP32, FP16_MASTER, AMP, BF16]
    assert ladder(TriageConfig(target="fp16", stages=("fp16",))) == [FP32, FP16_PURE]


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register("amp", lambda config: AMP)


class _Double:
    """A transform that doubles the copy's weights: the forward runs the copy, the FP32 model stays as it was."""

    name = "double"

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        import copy

        out = copy.deepcopy(model)
        with torch.no_grad():
            for p in out.parameters():
                p.mul_(2)
        return out

    def describe(self) -> dict[str, object]:
        return {"name": self.name}


def test_a_rung_runs_its_weight_dtype_then_its_transform_on_a_copy() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    w = model.weight.detach().clone()
    assert FP32.cast_model(model) is model
    half = FP16_MASTER.cast_model(model)
    assert half is not model and half.weight.dtype == torch.float16 and model.weight.dtype == torch.float32
    doubled = Rung("x2", transform=_Double()).cast_model(model, torch.device("cpu"))
    assert torch.equal(doubled.weight, 2 * w) and torch.equal(model.weight, w)
    both = Rung("x2h", params=torch.float16, transform=_Double()).cast_model(model)
    assert both.weight.dtype == torch.float16 and torch.equal(both.weight, (2 * w).half())
    assert Rung("x2", transform=_Double()).describe() == {
        "name": "x2", "compute": None, "params": "float32", "master": True, "scaler": False, "transform": {"name": "double"}}
    assert AMP.describe()["compute"] == "float16" and AMP.describe()["transform"] == {"name": "none"}
