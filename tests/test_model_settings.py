"""What the weights' shapes do not say about a model, recorded in a capture and checked at replay.

A dataclass config (nanoGPT's ``GPT(GPTConfig(...))``, kept as ``self.config``) is a constructor argument a capture
can record when every field is a literal, so the model rebuilds without a spec; and every module's settings
(``Dropout(p=0.2)``, an epsilon) are recorded, so a replay whose spec builds another model says so instead of
calling a deterministic failure a transient.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.errors import SpecError
from ampdoctor.input import origin

ROOT = Path(__file__).resolve().parents[1]


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


# --- end to end: a nanoGPT-shaped script (a dataclass config kept as self.config, dropout in it), run as a user runs
# it, from its own folder, in subprocesses

GPTLIKE = '''
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Cfg:
    d: int = 16
    depth: int = 2
    dropout: float = 0.0


class Net(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.body = nn.Sequential(*[nn.Linear(config.d, config.d) for _ in range(config.depth)])
        self.drop = nn.Dropout(config.dropout)
        self.head = nn.Linear(config.d, 2)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.body(x))))
'''

TRAIN = '''
import torch
from gptlike import Cfg, Net
from ampdoctor import Monitor

torch.manual_seed(0)
conf = Cfg(d=16, depth=3, dropout=0.2)
model = Net(conf)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
with Monitor(model, opt, sc, capture="cap", quiet=True) as mon:
    for step in range(10):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 2, (8,), generator=g)
        if step == 6:
            x[2, 3] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        mon.step(loss, batch=(x, y))
'''

WRONG_SPEC = '''
import torch
from gptlike import Cfg, Net


def build_model():
    return Net(Cfg(d=16, depth=3, dropout=0.0))


def loss_fn(output, y):
    return torch.nn.functional.cross_entropy(output.float(), y)
'''


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="80")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gptlike")
    (d / "gptlike.py").write_text(GPTLIKE)
    (d / "train.py").write_text(TRAIN)
    r = _run([sys.executable, "train.py"], d)
    assert r.returncode == 0 and (d / "cap" / "manifest.json").is_file(), r.stderr[-2000:]
    return d


def _triage(cwd: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    r = _run([sys.executable, "-c", "from ampdoctor.cli.app import main; main()", "triage", *extra,
              "--from", "cap", "--json", "rep.json", "--force"], cwd)
    assert r.returncode in (0, 1), r.stdout[-2000:] + r.stderr[-2000:]
    return r, json.loads((cwd / "rep.json").read_text())


@pytest.mark.slow
def test_a_dataclass_configured_model_replays_without_a_spec(gpt_run: Path) -> None:
    ident = json.loads((gpt_run / "cap" / "manifest.json").read_text())["model_identity"]
    assert ident["init_unknown"] == [] and ident["modules"]["drop"] == "Dropout(p=0.2, inplace=False)"
    r, rep = _triage(gpt_run)
    assert rep["verdict"]["cause"] == "data" and rep["verdict"]["first_step"] == 6, r.stdout[-3000:]
    text = " ".join(r.stdout.split())
    assert "Net(config=Cfg(d=16, depth=3, dropout=0.2))" in text
    assert "model is not the run's" not in text


@pytest.mark.slow
def test_a_spec_that_builds_another_model_is_said(gpt_run: Path) -> None:
    (gpt_run / "spec.py").write_text(WRONG_SPEC)
    r, rep = _triage(gpt_run, "spec.py")
    assert rep["verdict"]["cause"] == "data", r.stdout[-3000:]  # a NaN batch is NaN in any model
    text = " ".join(r.stdout.split())
    assert ("the replay's model is not the run's: drop is Dropout(p=0.0, inplace=False) here and "
            "Dropout(p=0.2, inplace=False) in the run") in text


def test_a_replay_of_another_model_that_stays_clean_is_no_transient() -> None:
    from ampdoctor.judge.rules import not_reproduced, shift_diagnosis
    from ampdoctor.report.words.verdicts import summary

    m = {"step": 16, "reason": "nonfinite_loss", "module": None}
    last = [{"loss": 2.5}, {"loss": 2.5}]
    plain = not_reproduced(m, 0, 2, last, "amp", 16, "cpu")
    assert plain is not None and plain.outcome.cause == "not_reproduced"
    differs = [("transformer.h.0.attn.attn_dropout", "Dropout(p=0.2, inplace=False)", "Dropout(p=0.0, inplace=False)"),
               ("transformer.h.0.mlp.dropout", "Dropout(p=0.2, inplace=False)", "Dropout(p=0.0, inplace=False)")]
    d = not_reproduced(m, 0, 2, last, "amp", 16, "cpu", differs)
    assert d is not None and d.outcome.cause == "replay_mismatch" and [f.code for f in d.outcome.fixes] == ["spec_model"]
    words = summary(d.outcome.facts)
    assert "transformer.h.0.attn.attn_dropout is Dropout(p=0.0, inplace=False) here and Dropout(p=0.2, inplace=False) " \
           "in the run (and 1 more module differs)" in words
    assert "transient: nondeterminism" not in words
    assert not_reproduced(m, 1, 2, last, "amp", 16, "cpu", differs) is None  # reproduced: the rules judge it
    shifted = shift_diagnosis(d, 16)  # the run's own steps (the replay started at the captured step 16), once
    assert shifted.outcome.step == 16 and "The run failed at step 16 (nonfinite_loss)" in summary(shifted.outcome.facts)
