"""Batches as people write them (issue 38, item 3): dicts with the everyday key pairs and tuples of more than
two run; a batch ampdoctor cannot split gets one line naming what it called and how to say otherwise
(``--batch-keys``, ``"batch_keys"`` in TRIAGE_OPTIONS). The rule is docs/spec-format.md's "Batches"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.triage import triage
from ampdoctor.input.batches import BatchKeys, describe_call, split
from ampdoctor.input.config import TriageConfig

from .conftest import write_spec

# One tiny real model per forward signature; each spec's first FP32 loss is checked against the loss computed
# by hand from batch 0 and the initial weights, so a wrong split (the whole dict as target, the target fed to
# the model) cannot pass.
_DICT_SPEC = """
import torch
from torch import nn
import torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
    def forward(self, {arg}):
        return self.head(torch.tanh(self.body({arg})))

def build_model():
    torch.manual_seed(0)
    return Net()

def build_dataloader():
    g = torch.Generator().manual_seed(1)
    return [{{"{inp}": torch.randn(4, 6, generator=g), "{tgt}": torch.randint(0, 3, (4,), generator=g)}}
            for _ in range(3)]

def loss_fn(output, target):
    return F.cross_entropy(output, target)
"""

PAIRS = [("image", "label", "x"),  # torchvision habit, forward(x): the image goes by position
         ("input", "target", "input"),  # forward(input): by name
         ("x", "y", "x"),
         ("inputs", "targets", "inputs"),
         ("pixel_values", "labels", "pixel_values"),
         ("pixel_values", "labels", "images")]  # a forward that takes none of the keys by name


def _first_loss(spec: Path, inp: str, tgt: str) -> float:
    ns: dict[str, object] = {}
    exec(compile(spec.read_text(), str(spec), "exec"), ns)
    model, batch = ns["build_model"](), ns["build_dataloader"]()[0]  # type: ignore[operator]
    return float(ns["loss_fn"](model(batch[inp]), batch[tgt]).detach())  # type: ignore[operator]


@pytest.mark.parametrize("inp,tgt,arg", PAIRS, ids=[f"{a}-{b}-{c}" for a, b, c in PAIRS])
def test_dict_key_pairs_run(tmp_path: Path, inp: str, tgt: str, arg: str) -> None:
    spec = write_spec(tmp_path, _DICT_SPEC.format(inp=inp, tgt=tgt, arg=arg))
    report, run = triage(spec, TriageConfig(steps=3, stages=("fp32",), device="cpu"))
    assert report.verdict.cause == "healthy", report.verdict.summary
    assert run.results["fp32"].records[0].loss == pytest.approx(_first_loss(spec, inp, tgt), rel=1e-5)


def test_tuple_of_three_is_inputs_then_target(tmp_path: Path) -> None:
    """(x, mask, y): model(x, mask), loss_fn(output, y) — a second model unlike the dict ones (two inputs)."""
    spec = write_spec(tmp_path, """
import torch
from torch import nn

class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 1)
    def forward(self, x, mask):
        return self.lin(x * mask)

def build_model():
    torch.manual_seed(0)
    return Masked()

def build_dataloader():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 5, generator=g), (torch.rand(4, 5, generator=g) > 0.3).float(), torch.randn(4, 1, generator=g))
            for _ in range(3)]

def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
""")
    report, run = triage(spec, TriageConfig(steps=3, stages=("fp32",), device="cpu"))
    ns: dict[str, object] = {}
    exec(compile(spec.read_text(), str(spec), "exec"), ns)
    x, m, y = ns["build_dataloader"]()[0]  # type: ignore[operator]
    want = float(nn.functional.mse_loss(ns["build_model"]()(x, m), y).detach())  # type: ignore[operator]
    assert report.verdict.cause == "healthy"
    assert run.results["fp32"].records[0].loss == pytest.approx(want, rel=1e-5)


def test_split_rule() -> None:
    class ByName(nn.Module):
        def forward(self, input_ids, attention_mask=None, labels=None):
            return input_ids

    class Positional(nn.Module):
        def forward(self, p, q):
            return p

    hf = {"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 3), "labels": torch.zeros(2, 3), "note": "x"}
    args, kwargs, target = split(hf, ByName())
    assert args == () and set(kwargs) == set(hf) and target is hf["labels"]  # model(**batch), as before
    two = {"a": torch.ones(1), "b": torch.ones(1) * 2, "y": torch.zeros(1), "id": "sample-7"}
    args, kwargs, target = split(two, Positional())
    assert [float(a) for a in args] == [1.0, 2.0] and kwargs == {} and target is two["y"]  # strings not passed
    nokey = {"a": torch.ones(1), "b": torch.ones(1)}
    assert split(nokey, Positional())[2] is nokey  # no target key: loss_fn gets the whole batch
    # the order of TARGET_KEYS decides when several are present
    both = {"x": torch.ones(1), "target": torch.ones(1), "labels": torch.zeros(1)}
    assert split(both, Positional())[2] is both["labels"]
    keys = BatchKeys.parse("b,a:y")
    args, kwargs, target = split(two, Positional(), keys)
    assert args == (two["b"], two["a"]) and kwargs == {} and target is two["y"]  # in the order named
    args, kwargs, target = split(hf, ByName(), BatchKeys.parse("input_ids:labels"))
    assert kwargs == {"input_ids": hf["input_ids"]} and target is hf["labels"]  # by name: the forward takes it
    args, _, target = split((torch.ones(1), torch.zeros(1), torch.ones(1) * 3), Positional(), BatchKeys.parse("0:2"))
    assert len(args) == 1 and float(target) == 3.0
    assert describe_call(two, Positional()) == "model(batch['a'], batch['b']) and loss_fn(output, batch['y'])"


_NO_TARGET_KEY = """
import torch
import torch.nn.functional as F
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Linear(4, 1)

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [{"features": torch.randn(8, 4, generator=g), "price": torch.randn(8, 1, generator=g)} for _ in range(3)]

def loss_fn(output, target):
    return F.mse_loss(output, target)
"""


def test_unsplittable_dict_is_one_line_naming_the_keys(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, _NO_TARGET_KEY)
    res = CliRunner().invoke(app, ["triage", str(spec), "--steps", "3", "--device", "cpu"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.output
    # nn.Linear.forward(input) takes neither key by name and none is a target key: both went by position, the
    # whole dict to loss_fn
    assert "TypeError: Linear.forward() takes 2 positional arguments but 3" in lines[0]
    assert "ampdoctor called model(batch['features'], batch['price']) and loss_fn(output, batch)" in lines[0]
    assert "--batch-keys features:price" in lines[0]


@pytest.mark.parametrize("how", ["option", "triage_options"])
def test_batch_keys_says_otherwise(tmp_path: Path, how: str) -> None:
    body = _NO_TARGET_KEY + ('\nTRIAGE_OPTIONS = {"batch_keys": "features:price"}\n' if how == "triage_options" else "")
    spec = write_spec(tmp_path, body)
    extra = ["--batch-keys", "features:price"] if how == "option" else []
    res = CliRunner().invoke(app, ["triage", str(spec), "--steps", "3", "--device", "cpu", "--stages", "fp32",
                                   "--json", str(tmp_path / "r.json"), *extra])
    assert res.exit_code == 0, res.output
    import json

    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["verdict"]["cause"] == "healthy"
    assert rep["config"]["batch_keys"] == "features:price"
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    torch.manual_seed(0)
    want = float(nn.functional.mse_loss(nn.Linear(4, 1)(x), y).detach())
    assert rep["stages"][0]["losses"][0] == pytest.approx(want, rel=1e-5)


def test_bad_batch_keys_are_one_line(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, _NO_TARGET_KEY)
    for keys, words in [("features", "takes INPUT[,INPUT...]:TARGET"), ("features:cost", "names 'cost', which the batch "
                                                                                        "does not hold (its keys are features, price)")]:
        res = CliRunner().invoke(app, ["triage", str(spec), "--steps", "3", "--device", "cpu", "--batch-keys", keys])
        assert res.exit_code == 2 and words in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_layers_takes_the_same_batches(tmp_path: Path) -> None:
    """`ampdoctor layers` splits batches by the same rule and takes --batch-keys (or TRIAGE_OPTIONS') too."""
    spec = write_spec(tmp_path, _NO_TARGET_KEY)
    res = CliRunner().invoke(app, ["layers", str(spec), "--steps", "1", "--device", "cpu"])
    assert res.exit_code == 2 and "--batch-keys features:price" in res.output
    res = CliRunner().invoke(app, ["layers", str(spec), "--steps", "1", "--device", "cpu", "--batch-keys", "features:price",
                                   "--csv", str(tmp_path / "t.csv")])
    assert res.exit_code == 0, res.output
    import pandas as pd

    rows = pd.read_csv(tmp_path / "t.csv")
    out = rows[(rows["module"] == "<model>") & (rows["kind"] == "act") & (rows["step"] == 0) & (rows["dtype"] == "fp16")]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    torch.manual_seed(0)
    want = float(nn.Linear(4, 1)(x).detach().abs().max())  # the model's output on the features, not on the price
    assert float(out["absmax"].iloc[0]) == pytest.approx(want, rel=1e-5)
