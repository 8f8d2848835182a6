"""What the weights' shapes do not say about a model, recorded in a capture and checked at replay.

A dataclass config (nanoGPT's ``GPT(GPTConfig(...))``, kept as ``self.config``) is a constructor argument a capture
can record when every field is a literal, so the model rebuilds without a spec; and every module's settings
(``Dropout(p=0.2)``, an epsilon) are recorded, so a replay whose spec builds another model says so instead of
calling a deterministic failure a transient.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import nn

from ampdoctor.errors import SpecError
from ampdoctor.input import origin


@dataclasses.dataclass
class Cfg:
    d: int = 16
    dropout: float = 0.0
    widths: tuple[int, ...] = (4, 8)
    bias: bool = True


class Net(nn.Module):
    def __init__(self, config: Cfg) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.d, config.d, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)


@dataclasses.dataclass
class DtypeCfg:
    d: int = 4
    dtype: torch.dtype = torch.float32


class DtypeNet(nn.Module):
    """A config with a field that is not a literal (a dtype): not recorded, the replay asks for a spec."""

    def __init__(self, config: DtypeCfg) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.d, config.d)


def test_a_dataclass_config_of_literals_is_recorded_and_rebuilt() -> None:
    net = Net(Cfg(d=8, dropout=0.2, widths=(1, 2, 3), bias=False))
    rec = origin.record(net)
    assert rec["init_unknown"] == []
    ident = {"class": f"{Net.__module__}.{Net.__qualname__}", **rec}
    kwargs, unknown = origin.init_kwargs(ident, "cap")
    assert unknown == []
    assert kwargs["config"] == Cfg(d=8, dropout=0.2, widths=(1, 2, 3), bias=False)
    assert origin.call_words("Net", kwargs, rec["init_args"]) == "Net(config=Cfg(d=8, dropout=0.2, widths=(1, 2, 3), bias=False))"


def test_a_config_with_a_non_literal_field_is_not_recorded() -> None:
    rec = origin.record(DtypeNet(DtypeCfg()))
    assert rec["init_unknown"] == ["config"] and "config" not in rec["init_args"]


def test_a_recorded_dataclass_of_another_module_is_refused_without_importing_it() -> None:
    ident = {"class": f"{Net.__module__}.Net",
             "init_args": {"config": repr({origin.DATACLASS: "os.path.Thing", "fields": {}})}}
    before = set(sys.modules)
    with pytest.raises(SpecError, match="not a dataclass of the model's own module"):
        origin.init_kwargs(ident, "cap")
    assert set(sys.modules) == before


def test_recorded_fields_the_dataclass_refuses_are_one_line() -> None:
    ident = {"class": f"{Net.__module__}.Net",
             "init_args": {"config": repr({origin.DATACLASS: f"{Cfg.__module__}.Cfg", "fields": {"nope": 1}})}}
    with pytest.raises(SpecError, match=r"Cfg\(\*\*recorded fields\) raised TypeError"):
        origin.init_kwargs(ident, "cap")


def test_module_settings_differences_name_the_module_and_both_settings() -> None:
    run = origin.structure(Net(Cfg(dropout=0.2)))
    assert run["drop"] == "Dropout(p=0.2, inplace=False)"
    assert origin.differences(run, Net(Cfg(dropout=0.2))) == []
    diff = origin.differences(run, Net(Cfg(dropout=0.0)))
    assert diff == [("drop", "Dropout(p=0.2, inplace=False)", "Dropout(p=0.0, inplace=False)")]


def test_a_module_one_side_lacks_and_an_epsilon_are_differences() -> None:
    a = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, eps=1e-5))
    b = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, eps=1e-6), nn.GELU(approximate="tanh"))
    diff = origin.differences(origin.structure(a), b)
    assert ("1", "LayerNorm((4,), eps=1e-05, elementwise_affine=True, bias=True)",
            "LayerNorm((4,), eps=1e-06, elementwise_affine=True, bias=True)") in diff
    assert ("2", "", "GELU(approximate='tanh')") in diff
    assert origin.differences({}, b) == [] and origin.differences(None, b) == []


def test_a_setting_only_one_pytorch_version_says_is_no_difference() -> None:
    now = nn.LayerNorm(4)
    older = {"": "LayerNorm((4,), eps=1e-05, elementwise_affine=True)"}  # before LayerNorm said bias=
    assert origin.differences(older, now) == []
    assert origin.differences({"": "LayerNorm((4,), eps=1e-06, elementwise_affine=True)"}, now) != []
    assert origin.differences({"": "RMSNorm((4,), eps=1e-05, elementwise_affine=True)"}, now) != []
    assert origin.differences({"": "LayerNorm((8,), eps=1e-05, elementwise_affine=True)"}, now) != []
