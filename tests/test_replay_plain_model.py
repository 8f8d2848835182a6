"""A plain PyTorch model replays without a spec (issue 45 item 6).

A model class defined in the user's module beside the training script, built with constructor arguments
(``mymodel.Net(d=64, layers=3)``), trained in a plain loop with ``Monitor(capture="cap")``: ``ampdoctor triage
--from cap``, run from that folder with no spec, rebuilds exactly that model (the folder the run imported it from,
the arguments from the script's text or the instance's attributes, the loss from the run's autograd graph), and a
capture never runs its own files. Everything runs in subprocesses from a temporary folder, as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # subprocesses: about 10 s each on a loaded 2-core machine

NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, d=16, layers=1):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(layers)])
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.blocks(x))
'''

TRAIN = '''
import torch
import mymodel
from ampdoctor import Monitor

torch.manual_seed(0)
model = mymodel.Net(d=64, layers=3)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
with Monitor(model, opt, sc, capture="cap") as mon:
    for step in range(24):
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 2, (8,), generator=g)
        if step == 20:
            x[3, 5] = float("nan")
        with mon.autocast():
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        mon.step(loss, batch=(x, y))
'''

# a second, unlike model: positional arguments from variables (not literals in the script), kept as attributes;
# a regression with mse_loss, a plain loop that steps itself
CONV = '''
import torch
from torch import nn


class Tower(nn.Module):
    def __init__(self, channels, depth, width=8):
        super().__init__()
        self.channels, self.depth = channels, depth
        self.body = nn.Sequential(*[nn.Conv1d(channels, channels, 3, padding=1) for _ in range(depth)])
        self.out = nn.Linear(channels * width, 1)

    def forward(self, x):
        return self.out(torch.relu(self.body(x)).flatten(1))
'''

TRAIN_CONV = '''
import sys
import torch
from nets.tower import Tower
from ampdoctor import Monitor

C, D = int("6"), int("2")
torch.manual_seed(0)
model = Tower(C, D)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(2)
with Monitor(model, opt, sc, capture="cap", quiet=True) as mon:
    for step in range(16):
        x, y = 0.1 * torch.randn(4, C, 8, generator=g), 0.1 * torch.randn(4, 1, generator=g)
        if step == 12:
            y[1, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        sc.scale(loss).backward()
        mon.after_backward(loss, batch=(x, y))
        sc.step(opt)
        sc.update()
        mon.after_step()
        opt.zero_grad()
'''


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # ampdoctor itself, not the user's folder
    return env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _triage(cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-c", "from ampdoctor.cli.app import main; main()", "triage", *extra], cwd)


@pytest.fixture(scope="module")
def net_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("plain")
    (d / "mymodel.py").write_text(NET)
    (d / "train.py").write_text(TRAIN)
    r = _run([sys.executable, "train.py"], d)
    assert r.returncode == 0 and (d / "cap" / "manifest.json").is_file(), r.stderr[-2000:]
    (d / "stderr.txt").write_text(r.stderr)
    return d


def test_the_replay_hint_asks_for_no_spec(net_run: Path) -> None:
    err = (net_run / "stderr.txt").read_text()
    assert "ampdoctor: step 20 failed" in err and "replay it: ampdoctor triage --from cap\n" in err + "\n", err
    assert "SPEC" not in err and "build_dataloader" not in err


def test_the_capture_records_where_the_class_came_from_and_its_arguments(net_run: Path) -> None:
    m = json.loads((net_run / "cap" / "manifest.json").read_text())
    ident = m["model_identity"]
    assert ident["class"] == "mymodel.Net" and ident["import_root"] == "." and ident["module_file"] == "mymodel.py"
    assert ident["init_args"] == {"d": "64", "layers": "3"} and ident["init_unknown"] == []
    assert m["loss_recipe"]["fn"] == "cross_entropy" and m["loss_recipe"]["float"] is True
    assert str(net_run) not in json.dumps(m["model_identity"])  # nothing of the machine's folders


def test_a_plain_model_with_constructor_arguments_replays_from_the_scripts_folder(net_run: Path) -> None:
    r = _triage(net_run, "--from", "cap", "--json", "-", "-q")
    assert r.returncode == 1, r.stderr[-2000:]  # (1: a verdict other than healthy)
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 20)
    notes = " ".join(rep["notes"])
    assert "Net(d=64, layers=3)" in notes and "mymodel.py in this folder" in notes and "cross_entropy" in notes


def test_from_another_folder_it_says_where_to_run_it(net_run: Path, tmp_path: Path) -> None:
    r = _triage(tmp_path, "--from", str(net_run / "cap"))
    assert r.returncode == 2 and "mymodel.Net cannot be imported" in r.stderr and "Traceback" not in r.stderr


def test_a_capture_never_runs_its_own_files(net_run: Path, tmp_path: Path) -> None:
    """Someone mails a capture holding a mymodel.py of its own: replayed from inside it (its folder is then this
    folder, and `python -m` puts it on the import path), the module is not imported."""
    cap = tmp_path / "cap"
    shutil.copytree(net_run / "cap", cap)
    (cap / "mymodel.py").write_text("open('ran', 'w').write('x')\n" + NET)
    for cmd in ([sys.executable, "-m", "ampdoctor", "triage", "--from", "."],
                [sys.executable, "-c", "from ampdoctor.cli.app import main; main()", "triage", "--from", "."]):
        r = _run(cmd, cap)
        assert r.returncode == 2 and "never runs a capture's own files" in r.stderr, r.stderr[-1500:]
        assert not (cap / "ran").exists()


def test_a_folder_outside_this_one_asks_for_trust(net_run: Path, tmp_path: Path) -> None:
    """A capture whose class came from a folder outside the one triage runs in needs --import-outside to put it on
    the import path."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "mymodel.py").write_text(NET)
    here = tmp_path / "work"
    shutil.copytree(net_run / "cap", here / "cap")
    mf = here / "cap" / "manifest.json"
    m = json.loads(mf.read_text())
    m["model_identity"]["import_root"] = "../code"
    mf.write_text(json.dumps(m))
    r = _triage(here, "--from", "cap", "-q")
    assert r.returncode == 2 and "outside this folder" in r.stderr and "--import-outside" in r.stderr, r.stderr[-1500:]
    r = _triage(here, "--from", "cap", "--import-outside", "--json", "-", "-q")
    assert r.returncode == 1 and json.loads(r.stdout)["verdict"]["first_step"] == 20, r.stderr[-1500:]


def test_arguments_it_cannot_read_are_said_when_the_defaults_do_not_fit(net_run: Path, tmp_path: Path) -> None:
    shutil.copytree(net_run / "cap", tmp_path / "cap")
    (tmp_path / "mymodel.py").write_text(NET)
    mf = tmp_path / "cap" / "manifest.json"
    m = json.loads(mf.read_text())
    m["model_identity"].update(init_args={}, init_unknown=["d", "layers"])  # as when the script passed variables
    mf.write_text(json.dumps(m))
    r = _triage(tmp_path, "--from", "cap", "-q")
    assert r.returncode == 2 and "could not read the model's constructor argument(s) d, layers" in r.stderr, r.stderr[-1500:]


@pytest.mark.slow
def test_a_second_model_in_a_package_with_arguments_from_variables_replays(tmp_path: Path) -> None:
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "__init__.py").write_text("")
    (tmp_path / "nets" / "tower.py").write_text(CONV)
    (tmp_path / "train.py").write_text(TRAIN_CONV)
    r = _run([sys.executable, "train.py"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    ident = json.loads((tmp_path / "cap" / "manifest.json").read_text())["model_identity"]
    assert ident["init_args"] == {"channels": "6", "depth": "2"} and ident["module_file"] == "nets/tower.py"
    r = _triage(tmp_path, "--from", "cap", "--json", "-", "-q")
    assert r.returncode == 1, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"]) == ("data", 12)
    assert "Tower(channels=6, depth=2)" in " ".join(rep["notes"]) and "mse_loss" in " ".join(rep["notes"])
