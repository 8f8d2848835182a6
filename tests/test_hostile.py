"""The hostile suite (issue 26): what users and their machines do to ampdoctor. Each class of input is one
parametrised test; every case must end in exit code 2, exactly one line on stderr naming what to fix,
no traceback, and nothing of the user's lost.

A full disk is simulated two ways: a 64 kB tmpfs mounted over a folder when the test runs as root (the
real ENOSPC, partial writes included), and otherwise by patching the one function that writes the bytes
(``io._write_fd`` for outputs, ``steplog._open_raw`` for the step log). Both paths run where they can.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from click.testing import CliRunner

from ampdoctor.capture.schema import errors as schema_errors
from ampdoctor.capture.schema import schema, validate_manifest
from ampdoctor.cli.app import app as typer_app
from ampdoctor.errors import CaptureError
from ampdoctor.watch.steplog import StepLogError, StepLogWarning, StepLogWriter
from ampdoctor.watch.steplog_read import read_step_log

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
app = typer.main.get_command(typer_app)
"""The click command, built once (Typer's runner builds it again on every call: 30 ms of 40)."""

SPEC = """
import torch
def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)
"""


def one_line(r: Any, *words: str) -> str:
    """The run failed as it must: exit 2, one stderr line holding ``words``, no traceback."""
    err = r.stderr
    lines = err.strip().splitlines()
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert len(lines) == 1, err
    assert "Traceback" not in r.output, r.output
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("spec") / "spec.py"
    p.write_text(SPEC)
    return p


# a full disk ------------------------------------------------------------------------------------

class Full:
    """A folder whose disk ``fill()`` makes full: a real 64 kB tmpfs, filled to the last block (root only), or the
    two functions that write bytes patched to fail as a full disk does (half a write, then ENOSPC)."""

    def __init__(self, path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path, self.kind, self.mp = path, kind, monkeypatch

    def fill(self) -> None:
        if self.kind == "tmpfs":
            with open(self.path / "filler", "wb", buffering=0) as f:  # every block; empty files (the probe) still fit
                try:
                    while True:
                        f.write(b"\0" * 1024)
                except OSError:
                    pass
            return
        from ampdoctor import io as aio
        from ampdoctor.watch import steplog

        def write_fd(fd: int, data: bytes) -> None:
            try:
                os.write(fd, data[: len(data) // 2])
            finally:
                os.close(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        self.mp.setattr(aio, "_write_fd", write_fd)
        self.mp.setattr(steplog, "_open_raw", lambda path, mode: Filling(path, mode, room=0))
        (self.path / "filler").write_bytes(b"\0")


@pytest.fixture(params=["tmpfs", "patched"])
def full(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Full]:
    folder = tmp_path / "full"
    folder.mkdir()
    if request.param == "patched":
        yield Full(folder, "patched", monkeypatch)
        return
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    try:
        yield Full(folder, "tmpfs", monkeypatch)
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


class Filling:
    """A raw log file on a disk with ``room`` bytes left: a write past it is cut short, the next refused."""

    def __init__(self, path: Path, mode: str, room: int) -> None:
        self.f = open(path, mode, buffering=0)  # noqa: SIM115
        self.room = room
        self.calls = 0

    def write(self, data: bytes) -> int:
        self.calls += 1
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.f.write(data[: self.room])
        self.room -= n
        return n  # type: ignore[no-any-return]

    def fileno(self) -> int:
        return self.f.fileno()

    def seek(self, *a: Any) -> int:
        return self.f.seek(*a)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.f.close()


def _log_csv(folder: Path) -> Path:
    p = folder.parent / "steps.csv"
    with StepLogWriter(p, mode="overwrite") as w:
        for i in range(40):
            w.write({"step": i, "lr": 1e-3, "grad_l2_pre_clip": 1.0, "grad_l2_post_clip": 1.0, "loss": 0.5,
                     "skipped": i == 20, "skip_reason": "nonfinite_grad" if i == 20 else "", "scaler_scale": 65536.0})
    return p


OUTPUTS = {  # option -> (arguments, the path the message names, pre-existing file kept with --force)
    "--json": (["triage", "{spec}", "--steps", "2", "--json", "{d}/r.json"], "r.json", True),
    "--report md": (["triage", "{spec}", "--steps", "2", "--report", "{d}/r.md"], "r.md", True),
    "--report html": (["triage", "{spec}", "--steps", "2", "--report", "{d}/r.html"], "r.html", True),
    "--dump-dir": (["triage", "{spec}", "--steps", "2", "--dump-dir", "{d}/dump"], "dump", False),
    "--log": (["triage", "{spec}", "--steps", "2", "--log", "{d}/s.csv"], "s.csv", False),
    "scaler --plot": (["scaler", "{csv}", "--plot", "{d}/p.png"], "p.png", True),
    "layers --csv": (["layers", "{spec}", "--steps", "1", "--csv", "{d}/l.csv"], "l.csv", True),
}


@pytest.mark.parametrize("option", sorted(OUTPUTS))
def test_a_full_disk_is_one_line_and_loses_nothing(full: Full, spec: Path, option: str) -> None:
    args, name, keeps = OUTPUTS[option]
    d = full.path
    csv = _log_csv(d) if "{csv}" in " ".join(args) else None
    old = d / name
    argv = [a.format(spec=spec, d=d, csv=csv) for a in args]
    if keeps:  # an existing output, overwritten with --force: on a full disk it must stay as it was
        old.write_bytes(b"OLD")
        argv.append("--force")
    full.fill()
    before = sorted(os.listdir(d))
    r = runner.invoke(app, argv)
    line = one_line(r, "cannot write", name, "needed", "no space left on device")
    assert "free some space" in line
    assert sorted(os.listdir(d)) == before, "a partial file or folder was left behind"
    if keeps:
        assert old.read_bytes() == b"OLD"


def test_json_to_a_full_stdout_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--json - > file` on a full disk (or /dev/full): one line naming stdout and the bytes."""
    from ampdoctor.cli import outputs
    from ampdoctor.errors import OutputError

    class FullStdout:
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", FullStdout())
    with pytest.raises(OutputError) as e:
        outputs.write_json_stdout('{"verdict": {}}')
    assert str(e.value).startswith("cannot write the JSON report to stdout: no space left on device (15 B needed)")
    assert "\n" not in str(e.value)


def _train(log: Path, steps: int) -> tuple[list[warnings.WarningMessage], Any]:
    from ampdoctor import Monitor

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = Monitor(model, opt, log=log, activations=False)
        for _ in range(steps):
            loss = model(torch.randn(4, 16)).pow(2).mean()
            mon.step(loss)  # the user's line: the warning must point here
        mon.close()
        mon.close()
    return [w for w in caught if issubclass(w.category, StepLogWarning)], mon


def test_the_step_log_on_a_disk_that_fills_mid_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Training goes on; one warning (at the user's line, and on the ampdoctor logger) names the path and the
    step; the rows written are whole; later writes are tried now and then and resume when space is back."""
    from ampdoctor.watch import steplog

    files: list[Filling] = []

    def opener(path: Path, mode: str) -> Filling:
        files.append(Filling(path, mode, room=3000))  # the disk fills up a few dozen steps in
        return files[-1]

    monkeypatch.setattr(steplog, "_open_raw", opener)
    log = tmp_path / "steps.csv"
    caplog.set_level("WARNING", logger="ampdoctor")
    caught, mon = _train(log, 200)
    assert mon.step_num == 200  # training went on
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    first_lost = mon.writer.lost_steps[0][0]
    assert str(log) in msg and f"from step {first_lost} on" in msg and "no space left on device" in msg
    assert Path(caught[0].filename).resolve() == Path(__file__).resolve()  # stacklevel: out of ampdoctor
    assert any("are being lost" in r.getMessage() for r in caplog.records)
    assert any("misses" in r.getMessage() for r in caplog.records)  # close() says which steps are missing
    read = read_step_log(log)  # whole rows only, the last one complete
    assert read.steps == list(range(first_lost)) and not read.notes
    assert files[0].calls < 200 - first_lost  # retried now and then, not every step
    # space comes back: the log resumes, and says so
    w = StepLogWriter(tmp_path / "again.csv")
    f = Filling(tmp_path / "again.csv", "wb", room=10**6)
    f.room = 0
    monkeypatch.setattr(steplog, "_open_raw", lambda path, mode: f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(10):
            if i == 4:
                f.room = 10**6
            w.write({"step": i, "lr": 1e-3, "grad_l2_pre_clip": 1.0, "grad_l2_post_clip": 1.0, "loss": 0.5,
                     "skipped": False, "skip_reason": "", "scaler_scale": None})
    w.close()
    assert w.rows_written > 0 and w.lost_steps and read_step_log(tmp_path / "again.csv").steps[-1] == 9


def test_the_step_log_on_a_full_disk(full: Full) -> None:
    full.fill()
    log = full.path / "steps.csv"
    caught, mon = _train(log, 400)  # 64 kB fill up within a few hundred rows (or at once, patched)
    assert mon.step_num == 400 and len(caught) == 1 and mon.writer.rows_lost > 0
    if log.exists() and log.stat().st_size:
        read_step_log(log)  # what is there reads back: no half line


def test_close_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.watch import steplog

    class Broken(Filling):
        def close(self) -> None:
            super().close()
            raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(steplog, "_open_raw", lambda path, mode: Broken(path, mode, room=10**6))
    w = StepLogWriter(tmp_path / "s.csv")
    w.write({"step": 0, "lr": 1e-3, "grad_l2_pre_clip": 1.0, "grad_l2_post_clip": 1.0, "loss": 0.5,
             "skipped": False, "skip_reason": "", "scaler_scale": None})
    w.close()
    w.close()


# malformed captures ---------------------------------------------------------------------------

def _make_capture(folder: Path, spec: Path) -> dict[str, Any]:
    """A capture folder as Monitor(capture=...) writes it (version 1), for the spec's model."""
    sys.path.insert(0, str(spec.parent))
    try:
        import importlib

        mod = importlib.import_module(spec.stem)
    finally:
        sys.path.remove(str(spec.parent))
    folder.mkdir(parents=True)
    model = mod.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scaler": dict(torch.amp.GradScaler("cpu").state_dict())}, folder / "state.pt")
    torch.save([mod.build_dataloader()[0]], folder / "batches.pt")
    manifest = {"schema_version": 1, "tool": "ampdoctor capture", "step": 7, "reason": "nonfinite_loss", "detail": "",
                "skip_reason": "nonfinite_loss", "module": None, "skipped": True, "loss": "nan", "grad_l2_pre_clip": None,
                "lr": 0.001, "scale": 65536.0, "growth_tracker": 0, "autocast_dtype": "float16", "precision": "amp",
                "device": "cpu", "versions": {"ampdoctor": "0.1.0", "torch": torch.__version__}, "monitor": {}, "rank": 0,
                "world_size": 1, "optimizer_layout": None, "state_step": 7, "snapshot_step": None, "batch_steps": [7],
                "files": ["batches.pt", "manifest.json", "state.pt"], "left_out": []}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory, spec: Path) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("cap") / "cap"
    return folder, _make_capture(folder, spec)


def test_the_hand_made_capture_replays(capture: tuple[Path, dict[str, Any]], spec: Path) -> None:
    r = runner.invoke(app, ["triage", str(spec), "--from", str(capture[0]), "-q"])
    assert r.exit_code in (0, 1) and "Traceback" not in r.output, r.output


def _drop(m: dict[str, Any], k: str) -> dict[str, Any]:
    return {a: b for a, b in m.items() if a != k}


MANIFESTS = {  # case -> (change to the manifest, words of the line)
    "a list": (lambda m: [m], "not an object of fields"),
    "no step": (lambda m: _drop(m, "step"), "field step is missing"),
    "step as text": (lambda m: {**m, "step": "7"}, "field step is the text '7'"),
    "batch_steps as text": (lambda m: {**m, "batch_steps": "7"}, "field batch_steps is the text"),
    "a batch step as text": (lambda m: {**m, "batch_steps": ["7"]}, "field batch_steps[0]"),
    "step true": (lambda m: {**m, "step": True}, "field step is true"),
    "step 10**40": (lambda m: {**m, "step": 10**40, "batch_steps": [10**40]}, "field step"),
    "step negative": (lambda m: {**m, "step": -1, "batch_steps": [-1]}, "field step is -1"),
    "step NaN": (lambda m: {**m, "step": math.nan}, "field step is nan"),
    "version 2": (lambda m: {**m, "schema_version": 2}, "upgrade ampdoctor"),
    "version text": (lambda m: {**m, "schema_version": "1"}, "field schema_version"),
    "files as text": (lambda m: {**m, "files": "state.pt"}, "field files"),
    "world_size text": (lambda m: {**m, "world_size": "2"}, "field world_size"),
    "precision unknown": (lambda m: {**m, "precision": "fp64"}, "field precision"),
    "layout garbage": (lambda m: {**m, "optimizer_layout": {"class": 3}}, "field optimizer_layout"),
    "batch_steps not ending at step": (lambda m: {**m, "batch_steps": [3]}, "not at the failing step 7"),
    "batch_steps longer than batches": (lambda m: {**m, "batch_steps": [6, 7]}, "batches.pt holds 1 batch"),
    "state after the step": (lambda m: {**m, "snapshot_step": 9}, "field snapshot_step"),
    "no state file": (lambda m: {**m, "files": ["batches.pt", "manifest.json"]}, "neither state.pt nor snapshot.pt"),
}
STATES = {  # case -> (change to state.pt, words)
    "model entry holds ints": (lambda s: {**s, "model": {k: 3 for k in s["model"]}}, "is 3, not a tensor"),
    "scaler of garbage": (lambda s: {**s, "scaler": "garbage"}, "entry scaler is the text 'garbage'"),
    "scaler negative scale": (lambda s: {**s, "scaler": {**s["scaler"], "scale": -1.0}}, "scaler.scale is -1.0"),
    "scaler NaN backoff": (lambda s: {**s, "scaler": {**s["scaler"], "backoff_factor": math.nan}}, "scaler.backoff_factor"),
    "scaler empty": (lambda s: {**s, "scaler": {}}, "has no 'scale'"),
    "optimizer a list": (lambda s: {**s, "optimizer": [1]}, "not an optimizer state_dict()"),
    "optimizer lacks betas": (lambda s: {**s, "optimizer": {"state": {}, "param_groups": [{"params": [0, 1, 2, 3]}]}},
                              "has no 'betas'"),
    "a list, not a dict": (lambda s: [s], "not the dict of model"),
    "no model": (lambda s: _drop(s, "model"), "entry model is missing"),
}
FILES = {  # case -> (file, bytes, words)
    "manifest not UTF-8": ("manifest.json", b"\xff\xfe\x00", "not UTF-8"),
    "manifest empty": ("manifest.json", b"", "not valid JSON"),
    "manifest nested 100000 deep": ("manifest.json", b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    "batches.pt truncated": ("batches.pt", b"PK\x03\x04", "batches.pt cannot be read"),
}


def _damaged(tmp_path: Path, capture: tuple[Path, dict[str, Any]]) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(capture[0], bad)
    return bad


@pytest.mark.parametrize("case", sorted(MANIFESTS) + sorted(STATES) + sorted(FILES))
def test_a_malformed_capture_is_one_line(tmp_path: Path, capture: tuple[Path, dict[str, Any]], spec: Path, case: str) -> None:
    bad = _damaged(tmp_path, capture)
    if case in MANIFESTS:
        change, words = MANIFESTS[case]
        (bad / "manifest.json").write_text(json.dumps(change(dict(capture[1]))))
        named = "manifest.json" if "batches.pt" not in words and "neither" not in words else str(bad)
    elif case in STATES:
        change, words = STATES[case]
        torch.save(change(torch.load(capture[0] / "state.pt")), bad / "state.pt")
        named = "state.pt" if "betas" not in words else str(bad)
    else:
        name, data, words = FILES[case]
        (bad / name).write_bytes(data)
        named = name
    r = runner.invoke(app, ["triage", str(spec), "--from", str(bad)])
    one_line(r, words, named)


def _json_values() -> Any:
    from hypothesis import strategies as st

    leaf = st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=8)
    return st.recursive(leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                        max_leaves=6)


def _malformed() -> Any:
    """Manifests that do not fit the schema (jsonschema says so): a field dropped, a field replaced by any JSON
    value, a field added, or something other than an object."""
    from hypothesis import strategies as st

    fields = sorted(schema()["properties"])
    return st.one_of(
        st.tuples(st.just("drop"), st.sampled_from(sorted(schema()["required"])), st.none()),
        st.tuples(st.just("set"), st.sampled_from(fields), _json_values()),
        st.tuples(st.just("whole"), st.none(), _json_values()),
    )


def _apply(base: dict[str, Any], change: tuple[str, Any, Any]) -> Any:
    kind, field, value = change
    if kind == "drop":
        return _drop(base, field)
    if kind == "set":
        return {**base, field: value}
    return value


def _invalid(doc: Any) -> bool:
    import jsonschema

    if not jsonschema.Draft202012Validator(schema()).is_valid(doc):
        return True
    try:
        validate_manifest(doc, "m.json")  # fits the schema, but not itself (batch_steps not ending at step...)
    except CaptureError:
        return True
    return False


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_500_malformed_manifests_each_give_exit_2(tmp_path: Path, capture: tuple[Path, dict[str, Any]], spec: Path) -> None:
    """Hypothesis builds 500 manifests that jsonschema refuses; every one is one line and exit 2 through the CLI."""
    from hypothesis import HealthCheck, assume, given, settings

    bad = _damaged(tmp_path, capture)
    seen = {"n": 0}

    @settings(max_examples=500, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(_malformed())
    def run(change: tuple[str, Any, Any]) -> None:
        doc = _apply(dict(capture[1]), change)
        assume(_invalid(doc))
        (bad / "manifest.json").write_text(json.dumps(doc))
        r = runner.invoke(app, ["triage", str(spec), "--from", str(bad)])
        one_line(r, "manifest.json")
        seen["n"] += 1

    run()
    assert seen["n"] >= 400, seen  # nearly every example was a malformed manifest, run through the CLI


def test_the_validator_agrees_with_jsonschema(capture: tuple[Path, dict[str, Any]]) -> None:
    """The schema drives ampdoctor's own validator (no jsonschema at run time): both say the same of any change."""
    import jsonschema
    from hypothesis import HealthCheck, given, settings

    check = jsonschema.Draft202012Validator(schema())
    jsonschema.Draft202012Validator.check_schema(schema())

    @settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(_malformed())
    def run(change: tuple[str, Any, Any]) -> None:
        doc = _apply(dict(capture[1]), change)
        assert check.is_valid(doc) == (not schema_errors(doc)), (doc, schema_errors(doc))

    run()
    assert not schema_errors(capture[1])


def test_the_capture_versions_agree() -> None:
    from ampdoctor.capture import schema as capture_schema
    from ampdoctor.capture import write as writer

    assert writer.CAPTURE_VERSION == capture_schema.CAPTURE_VERSION == schema()["properties"]["schema_version"]["const"]


# odd specs ------------------------------------------------------------------------------------

GOOD_DATA = SPEC.split("def loss_fn")[0].split("def build_model")[0] + "\n" + "def build_dataloader" + SPEC.split("def build_dataloader")[1]
SPECS = {  # case -> (spec source, words)
    "model on the meta device": (SPEC.replace("return torch.nn.Sequential(", "return torch.nn.Sequential(").replace(
        "torch.nn.Linear(8, 1))", "torch.nn.Linear(8, 1)).to('meta')"), "meta device"),
    "build_scheduler returns an int": (SPEC + "def build_scheduler(opt):\n    return 3\n", "not an LR scheduler"),
    "build_scheduler raises": (SPEC + "def build_scheduler(opt):\n    raise RuntimeError('no schedule')\n",
                               "build_scheduler(optimizer) raised RuntimeError"),
    "scheduler step raises": (SPEC + "class S:\n    def step(self):\n        raise ValueError('bad step')\n"
                              "def build_scheduler(opt):\n    return S()\n", "step() raised ValueError"),
    "sys.exit(3) in the loss": (SPEC.replace("    return torch.nn.functional.mse_loss(out, y)",
                                             "    import sys; sys.exit(3)"), "sys.exit(3)"),
    "sys.exit(3) in the dataloader": (SPEC.replace("    return [(torch.randn", "    import sys\n    yield from [(torch.randn")
                                      .replace("for _ in range(3)]", "for _ in range(1)]\n    sys.exit(3)"), "sys.exit(3)"),
    "sys.exit(3) at the first batch": (SPEC.replace("    g = torch.Generator()", "    import sys\n    sys.exit(3)\n    yield\n    g = torch.Generator()"),
                                       "sys.exit(3)"),
    "sys.exit(3) at step 1": (SPEC.replace("    return torch.nn.functional.mse_loss(out, y)",
                                           "    global N\n    N = globals().get('N', 0) + 1\n    if N > 3:\n        import sys; sys.exit(3)\n"
                                           "    return torch.nn.functional.mse_loss(out, y)"), "sys.exit(3)"),
    "optimizer holds none of the model's parameters": (
        SPEC + "def build_optimizer(params):\n    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)\n",
        "holds none of the model's parameters"),
}


@pytest.mark.parametrize("case", sorted(SPECS))
def test_an_odd_spec_is_one_line(tmp_path: Path, case: str) -> None:
    body, words = SPECS[case]
    p = tmp_path / "odd.py"
    p.write_text(body)
    r = runner.invoke(app, ["triage", str(p), "--steps", "2"])
    one_line(r, words, "odd.py")


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_a_spec_that_prints_does_not_corrupt_json_on_stdout(tmp_path: Path) -> None:
    """print() at import, in build_model and in the loss, and a C-level write to descriptor 1: all on stderr."""
    p = tmp_path / "chatty.py"
    p.write_text(SPEC.replace("def build_model():", "print('loading the spec')\ndef build_model():\n    print('building')")
                 .replace("def loss_fn(out, y):", "def loss_fn(out, y):\n    print('a loss')\n    import os; os.write(1, b'raw\\n')"))
    r = subprocess.run([sys.executable, "-m", "ampdoctor", "triage", str(p), "--steps", "2", "--json", "-"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"]["cause"] and "a loss" in r.stderr and "raw" in r.stderr and "building" in r.stderr


# options that cannot be -----------------------------------------------------------------------

def _scaler_file(tmp_path: Path, kind: str) -> Path:
    if kind == "ok":
        return _log_csv(tmp_path / "x")
    p = tmp_path / f"{kind}.csv"
    head = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"
    if kind == "step40":
        p.write_text(head + "0,0.1,1,1,1,0,,65536\n" + "1" * 40 + ",0.1,1,1,1,0,,65536\n")
    elif kind == "step20":
        p.write_text(head + "0,0.1,1,1,1,0,,65536\n" + "18446744073709551615,0.1,1,1,1,0,,65536\n")
    elif kind == "oneline20mb":
        p.write_text("x" * (20 << 20))
    return p


SCALER = {  # case -> (file kind, options, words)
    "alert rate 2": ("ok", ["--alert-rate", "2"], "--alert-rate"),
    "alert rate below 0": ("ok", ["--alert-rate", "-0.1"], "--alert-rate"),
    "alert rate nan": ("ok", ["--alert-rate", "nan"], "--alert-rate"),
    "growth_interval 0": ("ok", ["--growth-interval", "0"], "--growth-interval"),
    "backoff 1.5": ("ok", ["--backoff-factor", "1.5"], "--backoff-factor"),
    "backoff 1": ("ok", ["--backoff-factor", "1"], "--backoff-factor"),
    "backoff nan": ("ok", ["--backoff-factor", "nan"], "--backoff-factor"),
    "window 0": ("ok", ["--window", "0"], "--window"),
    "window 10**30": ("ok", ["--window", "1" + "0" * 30], "--window"),
    "a 40-digit step": ("step40", [], "column step, row 2"),
    "a step past int64": ("step20", [], "column step, row 2"),
    "a 20 MB single-line file": ("oneline20mb", [], "line 1 is 20,971,520 characters"),
}


@pytest.mark.parametrize("case", sorted(SCALER))
def test_scaler_settings_that_cannot_be(tmp_path: Path, case: str) -> None:
    kind, opts, words = SCALER[case]
    f = _scaler_file(tmp_path, kind)
    r = runner.invoke(app, ["scaler", str(f), *opts])
    one_line(r, words)


def test_hypothesis_step_logs_are_read_or_refused_in_one_line(tmp_path: Path) -> None:
    """Any text in a step log's cells: it is read, or a StepLogError of one line; never another exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    head = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale"
    cell = st.one_of(st.sampled_from(["0", "1", "nan", "inf", "-1", "", "1e400", "9" * 25, "0.5", '"', "a,b", " 3"]),
                     st.text(max_size=6), st.integers(-(2**70), 2**70).map(str))
    row = st.lists(cell, min_size=6, max_size=9).map(",".join)
    doc = st.lists(row, min_size=0, max_size=5).map(lambda rows: "\n".join([head, *rows]))
    p = tmp_path / "h.csv"

    @settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(doc, st.text(max_size=40), doc.map(lambda d: d + "\n")))
    def run(text: str) -> None:
        p.write_text(text, encoding="utf-8")
        try:
            log = read_step_log(p)
        except StepLogError as e:
            assert "\n" not in str(e)
            return
        assert all(0 <= s < 2**63 for s in log.steps)

    run()


EXTREMES = {  # case -> (options, words)
    "--seed 10**30": (["--seed", "1" + "0" * 30], "--seed"),
    "--steps with 12 digits": (["--steps", "123456789012"], "--steps 123456789012 is more than a triage takes"),
    "--skip-batches 10**30": (["--skip-batches", "1" + "0" * 30], "--skip-batches"),
    "--accumulate huge": (["--accumulate", "1" + "0" * 12], "--accumulate"),
    "--growth-interval huge": (["--growth-interval", "1" + "0" * 20], "--growth-interval"),
}


@pytest.mark.parametrize("case", sorted(EXTREMES))
def test_extreme_values_are_one_line(spec: Path, case: str) -> None:
    opts, words = EXTREMES[case]
    t0 = time.perf_counter()
    r = runner.invoke(app, ["triage", str(spec), *(["--steps", "2"] if "--steps" not in opts else []), *opts])
    one_line(r, words)
    assert time.perf_counter() - t0 < 20


def test_skipping_past_the_end_of_an_unsized_loader(tmp_path: Path) -> None:
    p = tmp_path / "gen.py"
    p.write_text(SPEC.replace("    return [(torch.randn", "    yield from [(torch.randn"))
    r = runner.invoke(app, ["triage", str(p), "--steps", "2", "--skip-batches", "4"])
    # past the end the skip goes on with the next epoch, as the run did; a generator yields none a second time
    one_line(r, "--skip-batches 4: build_dataloader() yields no batch in epoch 1 (after 3 in the epochs before)")


# misleading words -----------------------------------------------------------------------------

def test_a_pickled_checkpoint_advises_what_exists(tmp_path: Path, spec: Path) -> None:
    import argparse

    sys.path.insert(0, str(spec.parent))
    try:
        import importlib

        model = importlib.import_module(spec.stem).build_model()
    finally:
        sys.path.remove(str(spec.parent))
    ck = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(lr=1e-3)}, ck)
    r = runner.invoke(app, ["triage", str(spec), "--steps", "2", "--checkpoint", str(ck)])
    line = one_line(r, "pickled Python objects", "load_checkpoint(model, optimizer, scaler, path)")
    assert "--trust-checkpoint" not in line
    help_text = "".join(runner.invoke(app, [c, "--help"]).output for c in ("triage", "layers", "scaler"))
    assert "--trust" not in help_text  # the advice names no option that does not exist


@pytest.mark.slow  # end-to-end: out of the README command (under 5 min), in CI (-m slow)
def test_a_second_ctrl_c_exits_130(tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    p = tmp_path / "slow.py"
    p.write_text(f"import atexit, time, torch, pathlib\natexit.register(time.sleep, 30)\n"
                 "def build_model():\n    return torch.nn.Linear(3, 1)\n"
                 f"def build_dataloader():\n    pathlib.Path({str(mark)!r}).write_text('x')\n    time.sleep(60)\n    return []\n")
    proc = subprocess.Popen([sys.executable, "-m", "ampdoctor", "triage", str(p), "--steps", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.7)  # the first one is handled; its exit waits on the atexit sleep
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and "interrupted" in err
