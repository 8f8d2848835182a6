"""A CLI that reads like a mature one (issue 38, item 4): every --help fits 80 columns whole, piped and with
COLUMNS=80; placeholders in the ``--steps N`` convention; defaults shown; near-miss options get a hint; shell
completion; ``ampdoctor doctor`` says what this machine can run without building anything."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from ampdoctor.cli.app import app

COMMANDS = [[], ["triage"], ["layers"], ["scaler"], ["lint"], ["check"], ["build-kernel"], ["doctor"]]
runner = CliRunner()


def _help(args: list[str]) -> str:
    res = runner.invoke(app, [*args, "--help"], prog_name="ampdoctor", env={"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    return res.output


def _check_fits(text: str, what: str) -> None:
    for line in text.splitlines():
        assert len(line) <= 80, f"{what}: {len(line)} columns: {line!r}"
    assert "…" not in text, f"{what}: a description is cut"
    # the --steps N convention: no Python type names beside options
    assert not re.search(r"<(bool|str|int|float|path|list\[[^]]*\])>", text), f"{what}: a Python type as placeholder"


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "ampdoctor")
def test_help_fits_80_columns(args: list[str]) -> None:
    _check_fits(_help(args), " ".join(["ampdoctor", *args, "--help"]))


def test_help_piped_without_columns_fits() -> None:
    """A pipe (a CI log, `| less`) with no COLUMNS: the real process, as a user's shell runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    res = subprocess.run([sys.executable, "-m", "ampdoctor", "triage", "--help"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0
    _check_fits(res.stdout, "piped triage --help")
    assert "--steps" in res.stdout and "[default: 50]" in res.stdout


def test_triage_help_groups_options_and_shows_defaults() -> None:
    text = _help(["triage"])
    for panel in ("Run", "GradScaler", "Your code", "Replay a real run", "Output"):
        assert f"─ {panel} ─" in text
    for flag, placeholder, dflt in [("--steps", "N", "50"), ("--target", "TARGET", "amp"), ("--seed", "N", "0"),
                                    ("--init-scale", "X", "65536"), ("--growth-interval", "N", "2000")]:
        row = next(line for line in text.splitlines() if f" {flag} " in line)
        assert re.search(rf"{flag}\s+{placeholder}\s", row), row
        assert f"[default: {dflt}]" in text
    assert re.search(r"--force\s+Overwrite", text)  # a flag: no placeholder, no --no-force


@pytest.mark.parametrize("given,hint", [("--dtype", "--target"), ("--precision", "--target"), ("--max-steps", "--steps"),
                                        ("--grad-clip", "--max-norm"), ("--step", "--steps")])
def test_near_miss_options_get_a_hint(given: str, hint: str) -> None:
    res = runner.invoke(app, ["triage", "spec.py", given, "3"], env={"COLUMNS": "200"})
    assert res.exit_code == 2
    assert f"No such option: {given}" in res.output and hint in res.output, res.output


def test_a_hint_names_only_options_the_command_has() -> None:
    res = runner.invoke(app, ["scaler", "log.csv", "--dtype", "fp16"], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "--target" not in res.output
    for given in ("--target", "--precision"):  # layers says formats with --dtype
        res = runner.invoke(app, ["layers", "spec.py", given, "fp16"], env={"COLUMNS": "200"})
        assert res.exit_code == 2 and "did you mean --dtype" in res.output, res.output


def test_shell_completion() -> None:
    shown = subprocess.run([sys.executable, "-m", "ampdoctor", "--show-completion", "bash"], capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and "_AMPDOCTOR_COMPLETE=complete_bash" in shown.stdout, shown.stdout + shown.stderr
    env = {**os.environ, "_AMPDOCTOR_COMPLETE": "complete_bash", "COMP_WORDS": "ampdoctor triage --ste", "COMP_CWORD": "2"}
    out = subprocess.run([sys.executable, "-m", "ampdoctor"], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["--steps"], out.stdout + out.stderr


def test_version_stays() -> None:
    from ampdoctor._version import __version__

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"ampdoctor {__version__}"


def test_doctor_says_what_this_machine_runs() -> None:
    from ampdoctor.engine import doctor
    from ampdoctor.watch import fused

    before = dict(fused._state)
    res = runner.invoke(app, ["doctor"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = {line[3:].split("  ", 1)[0].strip(): line for line in res.output.splitlines()}
    assert torch.__version__ in lines["torch"]
    assert (torch.version.cuda or "none (CPU build of torch)") in lines["CUDA"]
    built = (fused.build_dir() / f"{fused.NAME}.so").exists()
    assert lines["statistics kernel"].startswith("ok" if built else "--"), lines["statistics kernel"]
    assert ("built" in lines["statistics kernel"]) and (("not built" in lines["statistics kernel"]) != built)
    assert fused._state == before  # looked at the file: nothing was built, started or loaded
    for pkg, extra in doctor.EXTRAS:
        try:
            want = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            want = f"pip install 'ampdoctor[{extra}]'"
        assert want in lines[pkg], lines[pkg]
    assert "fp16" in lines["cpu"] and "bf16" in lines["cpu"]
    if torch.cuda.is_available():
        assert "cuda:0" in lines and torch.cuda.get_device_name(0) in lines["cuda:0"]
    assert all(len(line) <= 80 for line in res.output.splitlines())


def test_doctor_when_the_kernel_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPDOCTOR_FUSED", "0")
    res = runner.invoke(app, ["doctor"])
    assert res.exit_code == 0 and "turned off (AMPDOCTOR_FUSED=0)" in res.output


@pytest.mark.parametrize("cap,fp16,bf16", [((9, 0), "fp16 (tensor cores)", "bf16"), ((7, 5), "fp16 (tensor cores)", "no bf16"),
                                           ((6, 1), "fp16", "bf16 emulated (slow)"), ((5, 0), "no fp16", "no bf16")])
def test_doctor_reads_each_cuda_device(monkeypatch: pytest.MonkeyPatch, cap: tuple[int, int], fp16: str, bf16: str) -> None:
    """The CUDA lines from the devices' compute capability (no GPU here: torch.cuda's answers stand in)."""
    from ampdoctor.engine import doctor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Test GPU {i}")
    monkeypatch.setattr(doctor, "_bf16_any", lambda i: cap == (6, 1))
    rows = {f.what: f for f in doctor.devices()}
    assert set(rows) == {"cpu", "cuda:0", "cuda:1"}
    assert rows["cuda:1"].found == f"Test GPU 1, sm_{cap[0]}{cap[1]}: {fp16}, {bf16}"
    assert rows["cuda:0"].ok is (cap >= (5, 3))
