"""``input.origin``: what a capture records of a plain model and its loss, and the replay's guards (issue 45 item 6).
The end-to-end runs, in subprocesses, are tests/test_replay_plain_model.py (slow)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampdoctor.errors import SpecError
from ampdoctor.input import origin


def _loss_twin(make: object, out: torch.Tensor, target: torch.Tensor) -> None:
    """The recorded loss, rebuilt, gives the run's loss on the same output and targets."""
    run = make(out, target)  # type: ignore[operator]
    recipe = origin.loss_recipe(run)
    assert recipe is not None
    again = origin.loss_fn_of(recipe, "cap")(out.detach().requires_grad_(), target)
    assert torch.equal(run.detach(), again.detach())


def test_the_loss_read_from_the_graph_is_the_runs_loss() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(5, 7)
    x, y = torch.randn(6, 5), torch.randint(0, 7, (6,))
    y[2] = 3
    _loss_twin(lambda o, t: F.cross_entropy(o.float(), t, ignore_index=3, reduction="sum"), lin(x), y)
    _loss_twin(lambda o, t: F.mse_loss(o, t), lin(x), torch.randn(6, 7))
    _loss_twin(lambda o, t: F.binary_cross_entropy_with_logits(o, t), lin(x), torch.rand(6, 7))
    _loss_twin(lambda o, t: F.smooth_l1_loss(o, t, beta=0.5), lin(x), torch.randn(6, 7))
    lm = nn.Linear(5, 11)  # a language model's logits (B, T, V), flattened to rows as nanoGPT does
    logits, tgt = lm(torch.randn(2, 3, 5)), torch.randint(0, 11, (2, 3))
    _loss_twin(lambda o, t: F.cross_entropy(o.view(-1, o.size(-1)), t.view(-1)), logits, tgt)


def test_a_loss_it_cannot_rebuild_records_nothing() -> None:
    lin = nn.Linear(5, 7)
    x, y = torch.randn(6, 5), torch.randint(0, 7, (6,))
    assert origin.loss_recipe(F.cross_entropy(lin(x), y, label_smoothing=0.1)) is None
    assert origin.loss_recipe(F.cross_entropy(lin(x), y, weight=torch.ones(7))) is None
    assert origin.loss_recipe(lin(x).pow(2).mean()) is None
    assert origin.loss_recipe(F.cross_entropy(lin(x), y) + lin.weight.norm()) is None  # a regulariser
    with pytest.raises(SpecError, match="does not know"):
        origin.loss_fn_of({"fn": "__import__", "reduction": "mean"}, "cap")


def test_constructor_arguments_are_literals_read_back_never_code() -> None:
    ident = {"init_args": {"d": "64", "shape": "(3, 4)"}, "init_unknown": []}
    assert origin.init_kwargs(ident, "cap") == ({"d": 64, "shape": (3, 4)}, [])
    for bad in ({"d": "__import__('os').system('x')"}, {"a b": "1"}, {"d": "x" * 5000}):
        with pytest.raises(SpecError, match="damaged"):
            origin.init_kwargs({"init_args": bad}, "cap")


def test_the_folder_goes_on_the_import_path_only_from_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = tmp_path / "work"
    (here / "cap").mkdir(parents=True)
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for d in (tmp_path, here, here / "cap"):
        (d / "m.py").write_text("X = 1\n")
    ident = {"class": "m.Net", "import_root": ".", "module_file": "m.py", "module_sha256": "0" * 64}
    assert origin.import_folder(ident, "cap", here / "cap", False) == "m.py in this folder, changed since the capture"
    assert sys.path[0] == str(here.resolve())
    assert origin.import_folder({**ident, "import_root": "elsewhere"}, "cap", here / "cap", False) == ""  # not here
    with pytest.raises(SpecError, match="--import-outside"):
        origin.import_folder({**ident, "import_root": ".."}, "cap", here / "cap", False)
    assert origin.import_folder({**ident, "import_root": ".."}, "cap", here / "cap", True).startswith("m.py in ../")
    with pytest.raises(SpecError, match="never runs a capture's own files"):
        origin.import_folder({**ident, "import_root": "cap"}, "cap", here / "cap", True)


def test_the_arguments_come_from_the_instance_when_the_script_does_not_say() -> None:
    class Block(nn.Module):
        def __init__(self, width: int, depth: int = 2, act: str = "gelu") -> None:
            super().__init__()
            self.width, self.act = width, act
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    got = origin.record(Block(12, 3))
    assert got["init_args"] == {"width": "12", "act": "'gelu'"} and got["init_unknown"] == ["depth"]


def test_the_replay_needs_what_the_capture_cannot_rebuild() -> None:
    plain = {"class": "mymodel.Net", "import_root": ".", "module_file": "mymodel.py", "init_args": {"d": "64"},
             "init_unknown": []}
    ce = {"fn": "cross_entropy", "reduction": "mean"}
    assert origin.replay_needs({"model_identity": plain, "loss_recipe": ce}) == []
    assert origin.replay_needs({"model_identity": plain}) == ["loss_fn(output, target)"]
    assert origin.replay_needs({"model_identity": {**plain, "init_unknown": ["layers"]}, "loss_recipe": ce}) == ["build_model()"]
    assert origin.replay_needs({"model_identity": {"class": "__main__.Net", "init_args": {}, "init_unknown": []},
                                "loss_recipe": {"fn": "model"}}) == ["build_model()"]
    bert = {"class": "transformers.BertForSequenceClassification", "transformers_config": {"hidden_size": 8}}
    lit = {"class": "mod.Lit", "lightning_hparams": {"d": 4}}
    assert origin.replay_needs({"model_identity": bert}) == [] == origin.replay_needs({"model_identity": lit})
    seq = origin.record(nn.Sequential(nn.Linear(2, 2)))  # *modules: not known
    assert origin.replay_needs({"model_identity": {"class": "torch.nn.Sequential", **seq}, "loss_recipe": ce}) == ["build_model()"]
