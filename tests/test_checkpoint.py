"""Reading training checkpoints: the layouts people have, and one clear line when it cannot."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ampdoctor.errors import CheckpointError
from ampdoctor.input.checkpoint import CheckpointState, match_optimizer, read_checkpoint
from ampdoctor.input.resume import load_into, match_state

from .conftest import ROOT

LIGHTNING_CKPT = ROOT / "tests" / "assets" / "lightning.ckpt"


class Net(nn.Module):
    """The model inside tests/assets/lightning.ckpt (see make_lightning_ckpt.py)."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def trained(steps: int = 3) -> tuple[Net, torch.optim.Optimizer, torch.amp.GradScaler]:
    """A tiny model after a few real AMP steps on the CPU: Adam moments and a scale that moved."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt, scaler


def one_line(e: pytest.ExceptionInfo[CheckpointError]) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------------- dict layout


@pytest.mark.parametrize(
    "names",
    [
        ("model", "optimizer", "scaler", "step"),  # PyTorch's AMP recipe
        ("model_state_dict", "optimizer_state_dict", "scaler_state_dict", "global_step"),
        ("state_dict", "optim", "grad_scaler", "iter_num"),  # nanoGPT counts iter_num
    ],
)
def test_dict_layouts(tmp_path: Path, names: tuple[str, str, str, str]) -> None:
    model, opt, scaler = trained()
    mk, ok, sk, stk = names
    path = tmp_path / "ckpt.pt"
    torch.save({mk: model.state_dict(), ok: opt.state_dict(), sk: scaler.state_dict(), stk: 1234, "epoch": 2}, path)

    state = read_checkpoint(path)
    assert (state.layout, state.step, state.source) == ("dict", 1234, path)
    assert_same_weights(state.model, model.state_dict())
    assert state.scaler is not None and state.scaler["scale"] == scaler.get_scale() == 2.0**13
    fresh = Net()
    opt2 = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(state.model)
    assert state.optimizer is not None
    opt2.load_state_dict(state.optimizer)
    assert torch.equal(opt2.state[fresh.fc1.weight]["exp_avg"], opt.state[model.fc1.weight]["exp_avg"])
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.load_state_dict(state.scaler)
    assert scaler2.get_scale() == 2.0**13


def test_load_into_live_objects(tmp_path: Path) -> None:
    model, opt, scaler = trained()
    torch.save({"module." + k: v for k, v in model.state_dict().items()}, tmp_path / "bare.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}, tmp_path / "full.pt")
    net = Net()
    opt2 = torch.optim.Adam(net.parameters(), lr=1e-2)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    assert load_into(read_checkpoint(tmp_path / "full.pt"), net, opt2, scaler2) == []
    assert scaler2.get_scale() == 2.0**13 and torch.equal(net.fc2.weight, model.fc2.weight)
    assert torch.equal(opt2.state[net.fc2.weight]["exp_avg_sq"], opt.state[model.fc2.weight]["exp_avg_sq"])
    said = load_into(read_checkpoint(tmp_path / "bare.pt"), Net(), torch.optim.Adam(Net().parameters()), torch.amp.GradScaler("cpu"))
    assert said == [f"{tmp_path / 'bare.pt'}: no optimizer state; the optimizer starts fresh (Adam's moments at zero)",
                    f"{tmp_path / 'bare.pt'}: no GradScaler state; the scale starts at 65536, not the run's"]


def test_bare_state_dict_and_numpy_entries(tmp_path: Path) -> None:
    model, _, _ = trained(1)
    torch.save(model.state_dict(), tmp_path / "bare.pth")
    state = read_checkpoint(tmp_path / "bare.pth")
    assert (state.layout, state.optimizer, state.scaler, state.step) == ("dict", None, None, None)
    assert_same_weights(state.model, model.state_dict())
    # numpy scalars (nanoGPT's best_val_loss) are data, not code: weights-only loading allows them
    torch.save({"model": model.state_dict(), "iter_num": np.int64(600), "best_val_loss": np.float64(2.5)}, tmp_path / "np.pt")
    assert read_checkpoint(tmp_path / "np.pt").step == 600


def test_rng_states_in_a_dict(tmp_path: Path) -> None:
    model, _, _ = trained(1)
    cpu = torch.get_rng_state()
    torch.save({"model": model.state_dict(), "rng_state": cpu}, tmp_path / "a.pt")
    rng = read_checkpoint(tmp_path / "a.pt").rng
    assert rng is not None and torch.equal(rng["cpu"], cpu)
    torch.save({"model": model.state_dict(), "torch_rng_state": cpu, "numpy_rng_state": np.random.get_state()}, tmp_path / "b.pt")
    rng = read_checkpoint(tmp_path / "b.pt").rng
    assert rng is not None and set(rng) == {"cpu", "numpy"} and rng["numpy"][0] == "MT19937"


def test_a_disabled_scaler_and_an_epoch_without_step(tmp_path: Path) -> None:
    model, _, _ = trained(1)
    torch.save({"model": model.state_dict(), "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(), "epoch": 3}, tmp_path / "c.pt")
    state = read_checkpoint(tmp_path / "c.pt")
    assert state.scaler is None and state.step is None
    assert any("disabled" in n for n in state.notes) and any("epoch 3" in n for n in state.notes)


def test_safetensors_file_is_detected_by_content_not_name(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")  # in the dev extra; transformers brings it too
    from safetensors.torch import save_file

    model, _, _ = trained(1)
    save_file(model.state_dict(), str(tmp_path / "weights.bin"))  # a misleading name
    state = read_checkpoint(tmp_path / "weights.bin", model=Net())
    assert_same_weights(state.model, model.state_dict())


# ---------------------------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def tiny_gpt2() -> Any:
    """GPT-2 from a tiny config: no download."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory, tiny_gpt2: Any) -> tuple[Path, Any]:
    """A real transformers Trainer, 2 steps on the CPU, saving every step."""
    pytest.importorskip("accelerate")  # the Trainer needs it
    from transformers import Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("trainer")
    model = tiny_gpt2
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 50, (8,), generator=g)), "labels": ids} for _ in range(8)]
    args = TrainingArguments(
        output_dir=str(out), max_steps=2, save_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True,
        disable_tqdm=True, logging_strategy="no",
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    return out, model


def gpt2(model: Any) -> Any:
    return type(model)(model.config)


def test_trainer_folder_written_by_a_real_trainer(trainer_run: tuple[Path, Any]) -> None:
    out, model = trainer_run
    ckpt = out / "checkpoint-2"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "optimizer.pt").is_file()
    state = read_checkpoint(ckpt, model=gpt2(model))
    assert (state.layout, state.step, state.scaler) == ("transformers", 2, None)  # no scaler.pt on the CPU
    assert state.rng is not None and {"python", "numpy", "cpu"} <= state.rng.keys()
    # safetensors leaves out lm_head.weight (tied to wte): filled from its twin, so loading is strict
    assert_same_weights(state.model, model.state_dict())
    fresh = gpt2(model)
    fresh.load_state_dict(state.model)
    assert state.optimizer is not None
    # the Trainer splits AdamW into decay / no-decay groups: a plain AdamW(model.parameters()) does not fit
    with pytest.raises(CheckpointError, match=r"2 parameter groups of \[6, 10\] parameters, build_optimizer\(\) makes 1 of \[16\]"):
        match_optimizer(torch.optim.AdamW(fresh.parameters()), state.optimizer)
    named = list(fresh.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and ".ln_" not in n]
    no_decay = [p for n, p in named if not (n.endswith("weight") and ".ln_" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}])
    match_optimizer(opt, state.optimizer)
    opt.load_state_dict(state.optimizer)
    trained_wte = next(p for n, p in model.named_parameters() if n == "transformer.wte.weight")
    assert state.optimizer["state"][0]["exp_avg"].shape == trained_wte.shape
    assert read_checkpoint(out / "checkpoint-1").step == 1


def test_trainer_folder_with_scaler_and_bin_weights(trainer_run: tuple[Path, Any], tmp_path: Path) -> None:
    """What a CUDA fp16 run adds (scaler.pt: Trainer saves accelerator.scaler.state_dict()), weights as .bin."""
    out, model = trainer_run
    ckpt = tmp_path / "checkpoint-7"
    shutil.copytree(out / "checkpoint-2", ckpt)
    (ckpt / "model.safetensors").unlink()
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    torch.save(torch.amp.GradScaler("cpu", init_scale=512.0).state_dict(), ckpt / "scaler.pt")
    state = read_checkpoint(ckpt)
    assert state.scaler is not None and state.scaler["scale"] == 512.0
    assert state.step == 2  # trainer_state.json, not the folder name
    assert_same_weights(state.model, model.state_dict())


def test_sharded_safetensors(tiny_gpt2: Any, tmp_path: Path) -> None:
    model = tiny_gpt2
    model.save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert_same_weights(read_checkpoint(tmp_path / "sharded", model=gpt2(model)).model, model.state_dict())
    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=f"{shards[-1]} is missing"):
        read_checkpoint(tmp_path / "sharded")


# ---------------------------------------------------------------------------------------------- lightning


def test_lightning_ckpt_written_by_lightning() -> None:
    """tests/assets/lightning.ckpt: Lightning 2.6.6, fp16 AMP on the CPU, 3 steps, scale 2**10 doubling each step."""
    state = read_checkpoint(LIGHTNING_CKPT)
    assert (state.layout, state.step) == ("lightning", 3)
    assert state.scaler is not None and (state.scaler["scale"], state.scaler["_growth_tracker"]) == (2.0**13, 0)
    assert state.optimizer is not None and state.optimizer["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert set(state.model) == {"loss_weight", "model.fc1.weight", "model.fc1.bias", "model.fc2.weight", "model.fc2.bias"}

    net = Net()
    mapped = read_checkpoint(LIGHTNING_CKPT, model=net)
    assert set(mapped.model) == set(net.state_dict())
    assert any("stripped the prefix 'model.'" in n and "loss_weight" in n for n in mapped.notes)
    net.load_state_dict(mapped.model)
    assert torch.equal(net.fc1.weight, state.model["model.fc1.weight"])
    opt = torch.optim.Adam(net.parameters())
    opt.load_state_dict(mapped.optimizer)  # type: ignore[arg-type]


def test_lightning_1x_scaler_key(tmp_path: Path) -> None:
    model, opt, scaler = trained()
    ckpt = {"state_dict": {f"net.{k}": v for k, v in model.state_dict().items()}, "optimizer_states": [opt.state_dict()],
            "global_step": 8217, "native_amp_scaling_state": scaler.state_dict(), "epoch": 0}
    torch.save(ckpt, tmp_path / "last.ckpt")
    state = read_checkpoint(tmp_path / "last.ckpt", model=Net())
    assert (state.layout, state.step, state.scaler and state.scaler["scale"]) == ("lightning", 8217, 2.0**13)
    assert_same_weights(state.model, model.state_dict())


# ---------------------------------------------------------------------------------------------- key mapping


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "model."])
def test_prefix_is_stripped(prefix: str) -> None:
    model, _, _ = trained(1)
    out = match_state(Net(), {prefix + k: v for k, v in model.state_dict().items()})
    assert_same_weights(out, model.state_dict())


def test_prefix_is_added_when_the_model_wraps() -> None:
    model, _, _ = trained(1)
    wrapper = nn.Sequential()
    wrapper.add_module("body", Net())
    out = match_state(wrapper, model.state_dict())
    assert set(out) == {f"body.{k}" for k in model.state_dict()}
    wrapper.load_state_dict(out)


NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(lambda n: not hasattr(nn.ModuleDict(), n))


def nest(inner: nn.Module, path: list[str]) -> nn.Module:
    for name in reversed(path):
        outer = nn.Module()
        outer.add_module(name, inner)
        inner = outer
    return inner


@settings(max_examples=40, deadline=None)
@given(
    layers=st.dictionaries(NAMES, st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=5),
    prefix=st.lists(NAMES, min_size=1, max_size=2),
    wrapped=st.booleans(),
)
def test_prefix_mapping_property(layers: dict[str, tuple[int, int]], prefix: list[str], wrapped: bool) -> None:
    """Any prefix of one or two components is stripped (checkpoint wrapped) or added (model wrapped), exactly."""
    inner = nn.ModuleDict({k: nn.Linear(a, b) for k, (a, b) in layers.items()})
    outer = nest(inner, prefix)
    saved, target = (outer, nn.ModuleDict({k: nn.Linear(a, b) for k, (a, b) in layers.items()})) if wrapped else (inner, nest(
        nn.ModuleDict({k: nn.Linear(a, b) for k, (a, b) in layers.items()}), prefix))
    out = match_state(target, saved.state_dict())
    target.load_state_dict(out)  # strict
    for a, b in zip(saved.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_from_another_model() -> None:
    model, _, _ = trained(1)
    with pytest.raises(CheckpointError) as e:
        match_state(Net(hidden=16), model.state_dict())
    msg = one_line(e)
    assert msg.startswith("the checkpoint is from another model: fc1.weight is 8x4 in the checkpoint, 16x4 in the model (+2 more shapes differ)")
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint_of(model, other)
    assert "the model has 0.weight, 0.bias, 1.weight (+1 more) that the checkpoint lacks" in one_line(e)
    assert "the checkpoint has fc1.weight, fc1.bias, fc2.weight (+1 more) that the model lacks" in str(e.value)


def read_checkpoint_of(model: nn.Module, other: nn.Module) -> CheckpointState:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        torch.save({"model": model.state_dict()}, Path(d) / "c.pt")
        return read_checkpoint(Path(d) / "c.pt", model=other)


def test_optimizer_from_another_setup() -> None:
    model, opt, _ = trained(1)
    net = Net()
    two_groups = torch.optim.Adam([{"params": [net.fc1.weight, net.fc1.bias]}, {"params": [net.fc2.weight, net.fc2.bias]}])
    with pytest.raises(CheckpointError, match=r"1 parameter groups of \[4\] parameters, build_optimizer\(\) makes 2 of \[2, 2\]"):
        match_optimizer(two_groups, opt.state_dict())


# ---------------------------------------------------------------------------------------------- what it cannot read


def test_truncated_file(tmp_path: Path) -> None:
    model, opt, scaler = trained(1)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    assert one_line(e).startswith(f"{path}: truncated or corrupt (")
    assert "use an earlier checkpoint" in str(e.value)
    torch.save(model.state_dict(), path, _use_new_zipfile_serialization=False)  # a truncated legacy pickle
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty file"):
        read_checkpoint(path)
    path.write_text("loss: nan\n")
    with pytest.raises(CheckpointError, match="not a PyTorch or safetensors checkpoint"):
        read_checkpoint(path)


def test_folder_without_weights(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-500"
    ckpt.mkdir()
    torch.save(trained(1)[1].state_dict(), ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(ckpt)
    assert one_line(e).startswith(
        "checkpoint-500/: found optimizer.pt, trainer_state.json but no model weights (model.safetensors or pytorch_model.bin); "
    )
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path)  # the Trainer's output_dir, not one checkpoint
    assert "holds checkpoint-500, not one checkpoint; pass one of them (the latest is" in one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="^empty/: an empty folder; pass the checkpoint"):
        read_checkpoint(tmp_path / "empty")


def test_dict_without_model_weights(tmp_path: Path) -> None:
    torch.save({"epoch": 3, "config": {"lr": 1e-3}, "best_loss": 1.5}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path / "c.pt")
    assert "a dict with keys epoch, config, best_loss but no model weights" in one_line(e)
    with pytest.raises(CheckpointError, match="no such file or folder"):
        read_checkpoint(tmp_path / "missing.pt")


def test_pickled_objects_are_refused_unless_trusted(tmp_path: Path) -> None:
    model, _, _ = trained(1)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(lr=1e-3), "step": 5}, path)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    msg = one_line(e)
    assert "holds pickled Python objects that weights-only loading refuses (argparse.Namespace)" in msg
    assert "load_checkpoint(model, optimizer, scaler, path)" in msg and "--trust" not in msg
    state = read_checkpoint(path, trust=True)
    assert state.step == 5
    assert_same_weights(state.model, model.state_dict())
    # the legacy (non-zip) format too, named from torch's refusal
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(lr=1e-3)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match=r"refuses \(argparse.Namespace\)"):
        read_checkpoint(path)


# ---------------------------------------------------------------------------------------------- the spec's loader


def test_spec_load_checkpoint(tmp_path: Path) -> None:
    model, opt, scaler = trained()
    path = tmp_path / "custom.npz"
    np.savez(path, **{k: v.numpy() for k, v in model.state_dict().items()}, step=np.array(77))

    def load_checkpoint(m: nn.Module, o: Any, s: Any, p: Path) -> int:
        data = np.load(p)
        m.load_state_dict({k: torch.from_numpy(data[k]) for k in m.state_dict()})
        s.load_state_dict(scaler.state_dict())
        return int(data["step"])

    net = Net()
    state = read_checkpoint(path, load_checkpoint=load_checkpoint, model=net, optimizer=torch.optim.Adam(net.parameters()),
                            scaler=torch.amp.GradScaler("cpu"))
    assert (state.layout, state.step) == ("spec", 77)
    assert state.scaler is not None and state.scaler["scale"] == 2.0**13
    assert_same_weights(state.model, model.state_dict())

    def broken(m: nn.Module, o: Any, s: Any, p: Path) -> None:
        raise KeyError("encoder")

    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path, load_checkpoint=broken, model=net)
    assert one_line(e) == f"{path}: the spec's load_checkpoint raised KeyError: 'encoder'"


def test_distributed_checkpoint_folder_says_how_to_convert(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    model, opt, _ = trained(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path / "dcp")
    assert "a torch.distributed.checkpoint folder (.metadata, __0_0.distcp); convert it to one file with python -m " in one_line(e)
    # the converted file reads as the dict layout
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "ckpt.pt")
    assert_same_weights(read_checkpoint(tmp_path / "ckpt.pt").model, model.state_dict())


# ---------------------------------------------------------------------------------------------- docs


def _doc_block(heading: str, lang: str) -> str:
    import re

    doc = (ROOT / "docs" / "checkpoints.md").read_text()
    block = re.search(rf"## {heading}\n\n.*?```{lang}\n(.*?)```", doc, re.S)
    assert block is not None, heading
    return block.group(1)


def test_refusals_in_docs_are_the_real_messages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    monkeypatch.chdir(tmp_path)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    Path("checkpoint-500").mkdir()
    torch.save(torch.optim.Adam(m.parameters()).state_dict(), "checkpoint-500/optimizer.pt")
    Path("checkpoint-500/trainer_state.json").write_text(json.dumps({"global_step": 500}))
    Path("runs/checkpoint-1").mkdir(parents=True)
    Path("runs/checkpoint-2").mkdir()
    torch.save({"model": m.state_dict(), "args": argparse.Namespace(lr=1)}, "ckpt.pt")
    Path("trunc.pt").write_bytes(Path("ckpt.pt").read_bytes()[: Path("ckpt.pt").stat().st_size // 2])
    torch.save({"model": m.state_dict()}, "other.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": m.state_dict()}, checkpoint_id="dcp")
    wider = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 1))
    got = []
    for path, model in [("checkpoint-500", None), ("runs", None), ("ckpt.pt", None), ("trunc.pt", None), ("other.pt", wider), ("dcp", None)]:
        with pytest.raises(CheckpointError) as e:
            read_checkpoint(path, model=model)
        got.append(one_line(e))
    assert "\n".join(got) + "\n" == _doc_block("What it refuses, in one line", "text")


def test_example_in_docs_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(_doc_block("Example", "python"), "checkpoints.md", "exec"), {})
    assert capsys.readouterr().out == "dict 8217 4096.0\n"
