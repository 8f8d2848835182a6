"""The hostile suite for trees and machines (issue 43), beside tests/test_hostile.py: ``lint`` on generated code and
odd trees (deep nesting, named pipes, unreadable files, broken config, the size and time budgets, one walk of the
tree per file), ``build-kernel`` and the Monitor with a read-only or full build folder, ``--nproc``'s temporary
folder on every way out, a UTF-16 step log. Each case is one line, no traceback, and nothing hangs.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ampdoctor.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
BAD = ("import torch\nfrom torch import nn\n\nmodel = nn.Linear(8, 1).cuda().half()\n"
       "optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n")
"""AMP005 (Adam on FP16 parameters) at line 5: a file with a finding beside the hostile one."""


def _lint(*args: str) -> subprocess.CompletedProcess[str]:
    """``ampdoctor lint ARGS`` in this process (the click runner), as a finished process."""
    r = runner.invoke(app, ["lint", *args])
    return subprocess.CompletedProcess(["ampdoctor", "lint", *args], r.exit_code, r.stdout, r.stderr)


def _lint_process(*args: str) -> subprocess.CompletedProcess[str]:
    """The same in a process of its own, ended after 120 s (a read that waits for ever fails the test)."""
    return subprocess.run([sys.executable, "-m", "ampdoctor", "lint", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


# 4. lint survives any text and any tree -----------------------------------------------------------------------

@pytest.mark.parametrize("text, why", [
    ("x = " + " + ".join(["a"] * 10_000) + "\n", "RecursionError"),  # a 10,000-term sum
    ("x = " + "-" * 100_000 + "1\n", "MemoryError"),  # a long chain of unary minus
])
def test_a_file_nested_too_deep_is_skipped_with_a_note_and_the_others_checked(tmp_path: Path, text: str,
                                                                                why: str) -> None:
    (tmp_path / "gen.py").write_text(text)
    (tmp_path / "train.py").write_text(BAD)
    r = _lint(str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    notes = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(notes) == 1 and "gen.py: skipped" in notes[0] and why in notes[0], r.stderr
    assert "train.py:5" in r.stdout and "AMP005" in r.stdout and "1 file checked, 1 not checked" in r.stdout


def test_a_named_pipe_called_py_is_never_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "ok.py").write_text("x = 1\n")
    r = _lint_process(str(tmp_path))  # would wait for a writer for ever
    assert r.returncode == 0 and "1 file checked" in r.stdout, r.stdout + r.stderr
    r = _lint_process(str(tmp_path / "pipe.py"))
    assert r.returncode == 2 and "pipe.py: not a regular file" in r.stderr and "Traceback" not in r.stderr


def test_an_unreadable_file_is_not_counted_as_checked(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("x = 1\n")
    (tmp_path / "gone.py").symlink_to(tmp_path / "nowhere.py")  # a dangling link: cannot be read, even by root
    r = _lint(str(tmp_path))
    assert r.returncode == 2 and "gone.py: cannot read" in r.stderr and "Traceback" not in r.stderr
    assert "(1 file checked, 1 not checked)" in r.stdout, r.stdout


@pytest.mark.parametrize("table, words", [
    ('[tool]\nampdoctor = "strict"\n', "tool.ampdoctor is str 'strict', not a table"),
    ("tool = 5\n", "tool is int '5', not a table"),
    ('[tool.ampdoctor]\nlint = "all"\n', "tool.ampdoctor.lint is str 'all', not a table"),
    ("[tool.ampdoctor.lint]\nexclude = 5\n", 'exclude is 5, not a list of strings; e.g. exclude = ["legacy/*.py"'),
])
def test_a_broken_config_is_one_line(tmp_path: Path, table: str, words: str) -> None:
    (tmp_path / "pyproject.toml").write_text(table)
    (tmp_path / "x.py").write_text("x = 1\n")
    r = _lint(str(tmp_path / "x.py"))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and words in lines[0], r.stderr
    assert "AMP0" not in lines[0].split("e.g.")[-1] or "exclude" not in words


def test_the_size_and_time_budgets_skip_a_file_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.lint import checker

    (tmp_path / "big.py").write_text("x = 1\n" * 100)
    (tmp_path / "small.py").write_text(BAD)
    monkeypatch.setattr(checker, "MAX_FILE_BYTES", 200)
    r = runner.invoke(app, ["lint", str(tmp_path)])
    assert r.exit_code == 1 and "big.py: skipped, 600 bytes is over the size budget of a file (200 bytes)" in r.stderr, r.output
    assert "(1 file checked, 1 not checked)" in r.stdout
    monkeypatch.setattr(checker, "MAX_FILE_BYTES", 1 << 20)
    monkeypatch.setattr(checker, "MAX_FILE_SECONDS", -1.0)
    r = runner.invoke(app, ["lint", str(tmp_path)])
    assert r.exit_code == 0 and r.stderr.count("the time budget of a file") == 2, r.output
    assert "AMP0" not in r.stdout and "(0 files checked, 2 not checked)" in r.stdout  # nothing half-checked


def test_one_walk_of_the_tree_per_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rule reads the file's one list of nodes: ``ast.walk`` never starts again from the module (a 5 MB
    generated file: bench/bench_lint_generated.py, docs/lint.md)."""
    from ampdoctor.lint import lint_source

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from bench_lint_generated import generate
    finally:
        sys.path.remove(str(ROOT / "bench"))
    src = generate(0.02) + "scaler = torch.amp.GradScaler()\nwith torch.autocast('cuda'):\n    y = f1(x)\n"
    whole: list[int] = []
    real = ast.walk

    def walk(node: ast.AST) -> Iterator[ast.AST]:
        if isinstance(node, ast.Module):
            whole.append(1)
        return real(node)

    monkeypatch.setattr(ast, "walk", walk)
    lint_source(src, "gen.py")
    assert len(whole) <= 1


# 5. build-kernel says what stopped it -----------------------------------------------------------------------------

@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A read-only folder and a full one: tmpfs mounts as root (the real EROFS and ENOSPC), else a folder without
    write permission (the full disk then needs root)."""
    ro, full = tmp_path / "ro", tmp_path / "full"
    ro.mkdir()
    full.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro, full
        ro.chmod(0o755)
        return
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True)
    (full / "filler").write_bytes(b"\0" * 60_000)
    try:
        yield ro, full
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
        subprocess.run(["umount", "-l", str(full)], capture_output=True)


def test_build_kernel_names_the_read_only_or_full_folder(mounted: tuple[Path, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ro, full = mounted
    for folder, words in ((ro, "cannot be written"), (full, "is full")):
        if folder == full and os.geteuid() != 0:
            continue
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder / "ext"))
        r = runner.invoke(app, ["build-kernel"])
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.exit_code == 2 and len(lines) == 1, r.output
        assert words in lines[0] and str(folder) in lines[0] and "TORCH_EXTENSIONS_DIR" in lines[0], lines[0]
        assert "compiler" not in lines[0]


def test_a_monitor_without_its_kernel_says_so_once_and_what_it_runs(mounted: tuple[Path, Path],
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from ampdoctor.engine.monitor import Monitor
    from ampdoctor.watch import fused

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(mounted[0] / "ext"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(fused, "_state", {"module": None, "proc": None, "failed": False})
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="ampdoctor"):
        for _ in range(2):  # a second Monitor in the same process says nothing more
            mon = Monitor(model, opt, log=None)
            for _ in range(3):
                loss = model(torch.randn(2, 4)).sum()
                loss.backward()
                mon.after_backward(loss)
                opt.step()
                mon.after_step()
                opt.zero_grad()
            mon.close()
    said = [r.getMessage() for r in caplog.records if "kernel" in r.getMessage()]
    assert len(said) == 1 and "cannot be written" in said[0] and "eager statistics" in said[0], said
    assert fused._state["proc"] is None  # no builder started for a folder it cannot write


# 6. --nproc leaves no temporary folder ------------------------------------------------------------------------

def test_nproc_removes_its_folder_on_ctrl_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.engine import shard_replay

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(shard_replay, "check", lambda cap, n: ({}, {0: tmp_path, 1: tmp_path}))

    def interrupted(*a: object, **k: object) -> None:
        assert list(tmp_path.glob("ampdoctor-ranks-*"))  # made before the ranks start
        raise KeyboardInterrupt

    monkeypatch.setattr("torch.multiprocessing.start_processes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        shard_replay.replay_ranks(tmp_path / "spec.py", tmp_path / "cap.rank0", 2)
    assert not list(tmp_path.glob("ampdoctor-ranks-*"))


def test_nproc_ends_its_ranks_and_removes_its_folder_when_joining_is_interrupted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.engine import shard_replay

    class Rank:
        def __init__(self) -> None:
            self.alive, self.terminated = True, False

        def is_alive(self) -> bool:
            return self.alive

        def terminate(self) -> None:
            self.terminated, self.alive = True, False

        def join(self, timeout: float | None = None) -> None:
            pass

    class Ctx:
        processes = [Rank(), Rank()]

        def join(self, timeout: float | None = None) -> bool:
            raise KeyboardInterrupt

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(shard_replay, "check", lambda cap, n: ({}, {0: tmp_path, 1: tmp_path}))
    monkeypatch.setattr("torch.multiprocessing.start_processes", lambda *a, **k: Ctx())
    with pytest.raises(KeyboardInterrupt):
        shard_replay.replay_ranks(tmp_path / "spec.py", tmp_path / "cap.rank0", 2)
    assert not list(tmp_path.glob("ampdoctor-ranks-*")) and all(p.terminated for p in Ctx.processes)


# 7. a UTF-16 step log ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding, named", [("utf-16", "UTF-16 (little-endian)"), ("utf-16-le", "UTF-16LE"),
                                             ("utf-16-be", "UTF-16BE")])
def test_a_utf16_step_log_names_its_encoding_and_how_to_convert(tmp_path: Path, encoding: str, named: str) -> None:
    log = tmp_path / "steps.csv"
    log.write_text("step,loss,scaler_scale,skipped\n0,1.5,65536,0\n1,1.4,65536,0\n", encoding=encoding)
    r = runner.invoke(app, ["scaler", str(log)])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert f"is {named} text" in lines[0] and "iconv -f" in lines[0] and "-t UTF-8 steps.csv" in lines[0]
