"""An accumulated step's capture replays (issue 28): the micro-batches given to ``mon.backward(loss, batch=)``
(or ``ampdoctor.MicroBatches`` given to the step) are kept together and replayed as one accumulated step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor import MicroBatches, Monitor
from ampdoctor.cli.app import app
from ampdoctor.errors import UsageError

SPEC = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 12, 2))

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 12, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(4)]

def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float(), y)
'''


def _run(tmp: Path, how: str) -> Path:
    ns: dict[str, object] = {}
    exec(SPEC, ns)
    model = ns["build_model"]()  # type: ignore[operator]
    loss_fn = ns["loss_fn"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    g = torch.Generator().manual_seed(3)
    with Monitor(model, opt, sc, capture=tmp / how, quiet=True) as mon:
        for step in range(40):
            micro = []
            for i in range(2):
                x, y = torch.randn(4, 3, 12, generator=g), torch.randint(0, 2, (4,), generator=g)
                if step == 30 and i == 1:
                    x[2, 1, 5] = float("nan")  # the second micro-batch of step 30
                micro.append((x, y))
                with mon.autocast():
                    loss = loss_fn(model(x), y) / 2  # type: ignore[operator]
                mon.backward(loss, batch=(x, y) if how == "backward" else None)
            rec = mon.step(batch=MicroBatches(micro) if how == "step" else None)
            if rec.capture:
                return Path(rec.capture)
    raise AssertionError("no capture")


@pytest.mark.parametrize("how", ["backward", "step"])
def test_an_accumulated_step_is_captured_with_its_micro_batches_and_replays(tmp_path: Path, how: str) -> None:
    cap = _run(tmp_path, how)
    m = json.loads((cap / "manifest.json").read_text())
    assert (m["step"], m["reason"]) == (30, "nonfinite_loss")
    kept = torch.load(cap / "batches.pt", weights_only=True)[-1]["ampdoctor_micro_batches"]
    assert len(kept) == 2 and torch.isnan(kept[1][0]).any() and not torch.isnan(kept[0][0]).any()
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(cap), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 30), r.output[-2000:]


def test_micro_batches_given_twice_is_a_usage_error(tmp_path: Path) -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, opt, capture=tmp_path / "cap", quiet=True) as mon:
        x = torch.ones(2, 3)
        mon.backward(model(x).sum(), batch=(x,))
        with pytest.raises(UsageError, match="micro-batches were given to backward"):
            mon.step(batch=(x,))


IMG_SPEC = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 1))

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 3, 64, 64, generator=g), torch.randn(8, 1, generator=g)) for _ in range(2)]

def loss_fn(out, y):
    return nn.functional.mse_loss(out.float(), y)
'''


def test_the_capture_holds_no_more_than_its_budget_and_still_re_reaches_the_step(tmp_path: Path) -> None:
    """Batches of 393 KB, a 2 MB budget, a snapshot every 100 steps: the capture takes snapshots early so what
    it holds stays within the budget, and an applied failure at step 57 replays from the last of them."""
    from ampdoctor.watch.steplog_read import read_step_log

    ns: dict[str, object] = {}
    exec(IMG_SPEC, ns)
    model = ns["build_model"]()  # type: ignore[operator]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    hold = 2_000_000
    g = torch.Generator().manual_seed(1)
    with Monitor(model, opt, capture=tmp_path / "cap", capture_hold_bytes=hold, log=tmp_path / "steps.csv",
                 quiet=True) as mon:
        for step in range(60):
            x, y = torch.randn(8, 3, 64, 64, generator=g), torch.randn(8, 1, generator=g)
            if step == 57:
                x[1, 0, 5, 5] = float("nan")
            loss = ns["loss_fn"](model(x), y)  # type: ignore[operator]
            loss.backward()
            mon.after_backward(loss, batch=(x, y))
            opt.step()  # a plain loop: the NaN step is applied
            mon.after_step()
            opt.zero_grad(set_to_none=True)
        early = mon.capture.early_snapshots  # type: ignore[union-attr]
    held = read_step_log(tmp_path / "steps.csv").frame["capture_held_bytes"].astype(int)
    assert held.max() <= hold and early >= 5, (held.max(), early)
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["step"], m["skipped"]) == (57, False) and m["snapshot_step"] < 57 <= m["snapshot_step"] + 5
    spec = tmp_path / "spec.py"
    spec.write_text(IMG_SPEC)
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "cap"), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 57), r.output[-2000:]


def test_every_micro_batch_is_the_models_input(tmp_path: Path) -> None:
    """Accumulated micro-batches are each the model's input: a NaN in the first one (not the last) is an input
    the rank exchange names ``input``, read first by the module that reads the batch."""
    from ampdoctor.judge import locate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, log=None)
    x1, x2 = torch.randn(3, 4), torch.randn(3, 4)
    x1[0, 0] = float("nan")
    for x in (x1, x2):
        mon.backward(model(x).pow(2).mean() / 2)
    rec = mon.step()
    mon.close()
    st = rec.stats
    assert st is not None and len(st.model_inputs) == 2
    assert locate.first_consumer_of_inputs(st) == "0"


LIST_SPEC = '''
import torch
from torch import nn

TRIAGE_OPTIONS = {"accumulate": 4}

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

def build_dataloader():  # each step: a plain list of its 4 (x, y) micro-batches, as the loop below
    g = torch.Generator().manual_seed(0)
    return [[(torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(4)]
            for _ in range(6)]

def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float(), y)
'''


def _list_run(tmp: Path, how: str) -> Path:
    """Issue 45 item 4: 4 micro-batches a step, given to the step as the plain list of (x, y) pairs; GradScaler's
    defaults; a NaN in the third micro-batch of step 30. ``how``: ``mon.backward`` (the Monitor counts 4 backward
    calls) or the loop's own backward with ``after_backward`` (4 forwards of the model)."""
    ns: dict[str, object] = {}
    exec(LIST_SPEC, ns)
    model = ns["build_model"]()  # type: ignore[operator]
    loss_fn = ns["loss_fn"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(3)
    with Monitor(model, opt, sc, capture=tmp / how, quiet=True) as mon:
        for step in range(40):
            micro = []
            for i in range(4):
                x, y = torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)
                if step == 30 and i == 2:
                    x[1, 3] = float("nan")
                micro.append((x, y))
                with mon.autocast():
                    loss = loss_fn(model(x), y) / 4  # type: ignore[operator]
                if how == "backward":
                    mon.backward(loss)
                else:
                    mon.note_loss(loss)
                    sc.scale(loss).backward()
            if how == "backward":
                rec = mon.step(batch=micro)
            else:
                mon.after_backward(batch=micro)
                sc.step(opt)
                sc.update()
                rec = mon.after_step()
                opt.zero_grad()
            if rec.capture:
                return Path(rec.capture)
    raise AssertionError("no capture")


def _triage(spec_text: str, tmp: Path, cap: Path) -> dict:  # type: ignore[type-arg]
    spec = tmp / "spec.py"
    spec.write_text(spec_text)
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(cap), "--json", "-", "-q"])
    assert r.exit_code in (0, 1), r.output[-2000:]  # (1: a verdict other than healthy)
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["backward", "after_backward"])
def test_a_plain_list_of_micro_batches_is_captured_as_the_steps_micro_batches(tmp_path: Path, how: str) -> None:
    cap = _list_run(tmp_path, how)
    m = json.loads((cap / "manifest.json").read_text())
    assert m["step"] == 30
    kept = torch.load(cap / "batches.pt", weights_only=True)[-1]["ampdoctor_micro_batches"]
    assert len(kept) == 4 and torch.isnan(kept[2][0]).any() and not torch.isnan(kept[1][0]).any()
    # it replays with a spec that says nothing of accumulation (the capture holds the grouping)
    rep = _triage(LIST_SPEC.replace('TRIAGE_OPTIONS = {"accumulate": 4}', ""), tmp_path, cap)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 30)


def test_a_captured_plain_list_replays_as_the_specs_accumulate(tmp_path: Path) -> None:
    """A capture whose batch is the plain list (as ampdoctor kept it before issue 45) replays as micro-batches when
    the spec's TRIAGE_OPTIONS says accumulate=4; it used to exit 2 ("does not run through the spec's model")."""
    cap = _list_run(tmp_path, "backward")
    f = cap / "batches.pt"
    torch.save([list(b["ampdoctor_micro_batches"]) for b in torch.load(f, weights_only=True)], f)
    rep = _triage(LIST_SPEC, tmp_path, cap)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 30)
    assert "[2][0]" in json.dumps(rep["verdict"])  # the third micro-batch's inputs


def test_a_dataloader_of_plain_lists_triages_with_the_specs_accumulate(tmp_path: Path) -> None:
    spec = tmp_path / "spec.py"
    spec.write_text(LIST_SPEC)
    r = CliRunner().invoke(app, ["triage", str(spec), "--steps", "3", "--json", "-", "-q"])
    assert r.exit_code == 0, r.output[-2000:]
    rep = json.loads(r.stdout)
    assert rep["verdict"]["cause"] == "healthy" and rep["config"]["accumulate"] == 4


def test_a_list_is_micro_batches_only_when_it_is_one_a_call() -> None:
    from ampdoctor.input.batches import Micro, as_micro

    x, y = torch.randn(4, 6), torch.randint(0, 2, (4,))
    pairs = [(x, y), (x, y), (x[:2], y[:2])]  # a short last micro-batch
    assert isinstance(as_micro(pairs, 3), Micro)
    assert not isinstance(as_micro(pairs, 2), Micro) and not isinstance(as_micro(pairs, 1), Micro)
    assert not isinstance(as_micro([x, y], 2), Micro)  # (inputs, targets) of one batch: not two micro-batches
    assert not isinstance(as_micro(tuple(pairs), 3), Micro)  # a tuple is one batch's parts
    assert not isinstance(as_micro([1, 2], 2), Micro)
