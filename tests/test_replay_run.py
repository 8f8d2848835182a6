"""The replay is the run (issue 22, items 1-3): ``triage --from`` / ``--checkpoint`` without a spec, the run's
optimizer groups, its RNG states restored, ``--skip-batches`` through epochs, and the run's own step numbers.

The Trainer test trains a tiny BERT (eager attention, the Trainer's default optimizer, fp16 with the
``torch.amp.GradScaler("cpu")`` accelerate would make on a GPU, as tests/test_integration_trainer.py does),
injects an attention overflow by scaling layer 1's query and key weights by 1000 before the step the Trainer
numbers 120 (its global_step after the step; q·k then reaches about 2.4e5 in FP32, past FP16's 65504), and
replays its capture and its checkpoint-130 with no ``build_model``. checkpoint-130 is saved after the Trainer's
step 130, so its replay's first step is the Trainer's step 131, which the step log numbers 131 too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.monitor import Monitor
from ampdoctor.engine.triage import triage
from ampdoctor.errors import SpecError
from ampdoctor.input import rebuild
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.rng import restore
from ampdoctor.watch.steplog_read import read_step_log
from tests.replay_models import Diffusion

runner = CliRunner()
ATT = "bert.encoder.layer.1.attention.self"


def _one_line(r: object, words: str) -> None:
    out = r.output  # type: ignore[attr-defined]
    assert r.exit_code == 2, out  # type: ignore[attr-defined]
    lines = [x for x in out.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and words in lines[0], out


# item 1: without a spec ---------------------------------------------------------------------------

def test_no_spec_and_nowhere_to_replay_from_is_one_line() -> None:
    _one_line(runner.invoke(app, ["triage"]), "no spec: give SPEC.py")


def test_a_class_of_the_training_script_itself_cannot_be_imported_one_line(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="defined in the training script itself"):
        rebuild.from_identity({"class": "__main__.Net"}, "cap")
    with pytest.raises(SpecError, match="needs constructor arguments the capture did not record"):
        rebuild.from_identity({"class": "torch.nn.Linear"}, "cap")
    with pytest.raises(SpecError, match="no model_identity"):
        rebuild.from_identity(None, "cap")
    rb = rebuild.from_identity({"class": "tests.replay_models.Diffusion"}, "cap")
    assert isinstance(rb.build(), Diffusion) and "tests.replay_models.Diffusion" in rb.source


def test_trainer_decay_groups_are_rebuilt_by_name_from_the_optimizer_state() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, max_position_embeddings=32, num_labels=2))
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    assert rebuild.trainer_decay_names(model) == decay
    named = list(model.named_parameters())
    groups = [[p for n, p in named if n in decay], [p for n, p in named if n not in decay]]
    run_opt = torch.optim.AdamW([{"params": groups[0], "weight_decay": 0.01}, {"params": groups[1], "weight_decay": 0.0}])
    state = run_opt.state_dict()
    build, how = rebuild.optimizer_from_state(model, state, "checkpoint-130")
    opt = build(model)
    assert [len(g["params"]) for g in opt.param_groups] == [17, 24] and "decay" in how
    opt.load_state_dict(state)  # the saved state fits the groups it was saved with
    one = torch.optim.AdamW(model.parameters()).state_dict()
    assert [len(g["params"]) for g in rebuild.optimizer_from_state(model, one, "x")[0](model).param_groups] == [41]
    bad = {"state": {}, "param_groups": [{**state["param_groups"][0], "params": list(range(5))}]}
    with pytest.raises(SpecError, match="1 parameter group"):
        rebuild.optimizer_from_state(model, bad, "x")


# item 2: RNG and epochs ---------------------------------------------------------------------------

def test_rng_states_of_a_capture_and_of_a_trainer_checkpoint_are_restored() -> None:
    from ampdoctor.capture.state import rng_states

    for take in (rng_states, lambda: {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}):
        saved = take()
        first = (torch.rand(3), np.random.rand(), random.random())
        assert restore(saved) == ["torch", "numpy", "python"]
        again = (torch.rand(3), np.random.rand(), random.random())
        assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


EPOCH_SPEC = '''
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

def build_dataloader():
    ds = TensorDataset(torch.arange(16.0).reshape(16, 1).repeat(1, 4), torch.zeros(16, 1))
    return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3))

def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)
'''


def test_skip_batches_past_the_epoch_goes_on_with_the_next_epoch_as_the_run_did(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    spec = tmp_path / "spec.py"
    spec.write_text(EPOCH_SPEC)
    ds = TensorDataset(torch.arange(16.0).reshape(16, 1).repeat(1, 4), torch.zeros(16, 1))
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3)
    run_batches = []
    for epoch in range(3):  # the run's loop
        sampler.set_epoch(epoch)
        run_batches += list(DataLoader(ds, batch_size=4, sampler=sampler))
    report, run = triage(spec, TriageConfig(steps=3, stages=("fp32",)), skip_batches=6)
    for got, want in zip(run.batches.items, run_batches[6:9], strict=True):  # epoch 1's batches 2, 3, then epoch 2's first
        assert torch.equal(got[0], want[0])
    assert any("1 whole epoch(s)" in n and "set_epoch" in n for n in report.notes), report.notes


def test_a_random_sampler_without_a_generator_says_its_later_epochs_are_not_the_runs(tmp_path: Path) -> None:
    spec = tmp_path / "spec.py"
    spec.write_text(EPOCH_SPEC.replace("sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3)",
                                       "shuffle=True"))
    report, _ = triage(spec, TriageConfig(steps=2, stages=("fp32",)), skip_batches=5)
    assert any("has no generator" in n and "may not be the run's" in n for n in report.notes), report.notes


# a step that draws its randomness ------------------------------------------------------------------

def _diffusion_run(tmp: Path, steps: int = 40) -> tuple[list[int], int]:
    """A loop whose loss draws the timestep in the step (Diffusion.forward); a dict checkpoint is saved before
    every step with the RNG state, as a loop that saves its RNG does. Returns the drawn t's and the first step
    that overflowed."""
    torch.manual_seed(0)
    model = Diffusion()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    mon = Monitor(model, opt, scaler, amp_dtype=torch.float16, capture=tmp / "cap", quiet=True)
    g = torch.Generator().manual_seed(1)
    ts, first = [], None
    for s in range(steps):
        x = torch.randn(16, 8, generator=g)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(), "step": s,
                    "rng_state": torch.get_rng_state()}, tmp / f"ckpt{s}.pt")
        torch.save(x, tmp / f"x{s}.pt")
        with mon.autocast():
            out = model(x)
        ts.append(int(out["t"]))
        rec = mon.step(out["loss"], batch=x)
        if first is None and rec.skipped:
            first = s
    mon.close()
    assert first is not None
    return ts, first


DIFF_SPEC = '''
import torch
from pathlib import Path
from tests.replay_models import Diffusion

def build_model():
    return Diffusion()

def build_dataloader():
    return [torch.load(Path(__file__).parent / "x{S}.pt")]
'''


def test_a_timestep_drawn_in_the_step_replays_the_runs_draw_every_time(tmp_path: Path) -> None:
    ts, first = _diffusion_run(tmp_path)
    assert ts[first] >= 900 and sum(t >= 900 for t in ts[:first]) == 0  # only some draws overflow: this one did
    spec = tmp_path / "spec.py"
    spec.write_text(DIFF_SPEC.replace("{S}", str(first)))
    seen = set()
    for seed in (0, 1, 2):  # the checkpoint's RNG, not --seed, decides the draw
        r = runner.invoke(app, ["triage", str(spec), "--checkpoint", str(tmp_path / f"ckpt{first}.pt"), "--steps", "1",
                                "--seed", str(seed), "--json", "-", "-q"])
        rep = json.loads(r.stdout)
        v = rep["verdict"]
        seen.add((v["cause"], v["first_module"], v["first_step"]))
        assert rep["config"]["rng_restored"] == ["torch"]
        # item 3: every step the run's own, from the data: the scale story, the evidence, the start's words
        assert rep["scaler"]["init_scale"] == 256.0 and [e["step"] for e in rep["scaler"]["skips"]] == [first]
        assert rep["config"]["start"] == f"the checkpoint ckpt{first}.pt"
        weights = [f["evidence"].get("fp32_recheck_weights") for f in rep["findings"]]
        assert all(w is None or w in (f"the checkpoint ckpt{first}.pt", f"stage amp before step {first}") for w in weights), weights
    assert seen == {("fp16_forward_overflow", "inp", first)}, seen
    # the capture of the same run, replayed with no spec at all: the same verdict every time
    verdicts = set()
    for _ in range(3):
        r = runner.invoke(app, ["triage", "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
        rep = json.loads(r.stdout)
        verdicts.add((rep["verdict"]["cause"], rep["verdict"]["first_step"]))
        assert any("RNG restored" in n for n in rep["notes"]) and any("Diffusion()" in n for n in rep["notes"])
    assert len(verdicts) == 1 and next(iter(verdicts))[1] == first, verdicts


# the Trainer, end to end ---------------------------------------------------------------------------

DATA_SPEC = '''
import torch
from tests.test_integration_trainer import Data

def build_dataloader():
    return torch.utils.data.DataLoader(Data(), batch_size=8, shuffle=True)
'''


@pytest.mark.slow
def test_a_trainer_runs_capture_and_checkpoint_replay_without_a_spec(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    from ampdoctor.integrations.transformers import AmpDoctorCallback
    from tests.test_integration_trainer import Data

    AcceleratorState._reset_state(reset_partial_state=True)

    class Inject(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 119:  # the step the Trainer logs as 120
                att = model.bert.encoder.layer[1].attention.self
                with torch.no_grad():
                    att.query.weight.mul_(1000.0)
                    att.key.weight.mul_(1000.0)

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2, attn_implementation="eager"))
    args = TrainingArguments(str(tmp_path / "trainer"), per_device_train_batch_size=8, max_steps=131, use_cpu=True,
                             report_to=[], logging_steps=10, save_strategy="steps", save_steps=130, disable_tqdm=True,
                             seed=0, fp16=True)
    tr = Trainer(model=model, args=args, train_dataset=Data(),  # type: ignore[arg-type]
                 callbacks=[AmpDoctorCallback(log=tmp_path / "steps.csv", capture=tmp_path / "cap", quiet=True), Inject()])
    tr.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # what accelerate makes on a GPU
    tr.accelerator.native_amp = True
    tr.train()
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["step"], m["reason"], m["monitor"]["step_convention"]) == (120, "nonfinite_loss", "trainer_global_step")
    log = read_step_log(tmp_path / "steps.csv").frame.set_index("step")
    assert log.index[0] == 1 and log.index[-1] == 131 and log.loc[120, "skip_reason"] == "nonfinite_loss"
    assert bool(log.loc[119:, "skipped"].iloc[1:].all()) and not bool(log.loc[119, "skipped"])
    # the capture, no spec: the model from its config, the Trainer's two groups from the captured layout
    r = runner.invoke(app, ["triage", "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    v = rep["verdict"]
    assert (v["cause"], v["first_module"], v["first_step"]) == ("fp16_forward_overflow", ATT, 120), r.output
    assert any("BertForSequenceClassification, rebuilt from the transformers config" in n and "eager" in n
               for n in rep["notes"]), rep["notes"]
    assert any("2 parameter group(s)" in n for n in rep["notes"])
    # checkpoint-130, no build_model and no build_optimizer: the batches from a data-only spec
    spec = tmp_path / "data.py"
    spec.write_text(DATA_SPEC)
    ck = tmp_path / "trainer" / "checkpoint-130"
    r = runner.invoke(app, ["triage", str(spec), "--checkpoint", str(ck), "--skip-batches", "130", "--steps", "2",
                            "--attn-implementation", "eager", "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    v = rep["verdict"]
    assert (v["cause"], v["first_module"], v["first_step"]) == ("fp16_forward_overflow", ATT, 131), r.output
    assert any("weight-decay and no-decay groups" in n and "[17, 24]" in n for n in rep["notes"]), rep["notes"]
    assert any("saved after the run's step 130, so the replay's first step is its step 131" in n for n in rep["notes"])
    assert rep["scaler"]["init_scale"] == float(torch.load(ck / "scaler.pt", weights_only=True)["scale"])  # not 2^16
    assert rep["config"]["rng_restored"] == ["torch", "numpy", "python"]
