"""The output blocks in docs/ are what the commands print today: text exactly, and numbers within the
precision the arithmetic supports (tests/doc_compare.py), so that they hold on every CPU kernel set."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import ampdoctor.cli.layers as cli_layers
from ampdoctor.cli.app import app

from .doc_compare import differences, numbers_close, skeleton

ROOT = Path(__file__).resolve().parent.parent
LAYERS_CMD = "ampdoctor layers sample_models/forward_overflow.py --dtype fp16,bf16 --scale auto --top 10 --device cpu"


def doc_block(doc: str, command: str) -> str:
    text = (ROOT / "docs" / doc).read_text()
    m = re.search(r"```\w*\n\$ " + re.escape(command) + r"\n(.*?)```", text, re.S)
    assert m, f"docs/{doc} has no block starting with $ {command}"
    return m.group(1)


def run(monkeypatch: pytest.MonkeyPatch, command: str, width: int) -> tuple[int, str]:
    buf = io.StringIO()
    monkeypatch.setattr(cli_layers, "out", Console(file=buf, width=width, force_terminal=False, color_system=None))
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(app, command.split()[1:])
    return r.exit_code, "".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines())


def test_layers_sample_in_docs_is_what_it_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    code, text = run(monkeypatch, LAYERS_CMD, 100)  # docs/layers.md: COLUMNS=100
    assert code == 0, text
    assert differences(doc_block("layers.md", LAYERS_CMD), text) == []


def test_numbers_compare_within_fp16_precision_and_text_exactly() -> None:
    assert numbers_close("1.2e-05", "1.1e-05")  # below FP16's smallest normal, 2^-14
    assert numbers_close("7.571e+04", "7.572e+04")  # the last printed digit
    assert not numbers_close("7.571e+04", "7.59e+04")
    assert not numbers_close("0.5065", "0.5427") and not numbers_close("17", "18")
    assert numbers_close("0.0488%", "0.0488%") and not numbers_close("3.1%", "1.6%")
    assert skeleton("blocks.1.attn  act  2^-3   7.5") == skeleton("blocks.1.attn act 2^-3 7.6")
    assert skeleton("scale 2^-3") != skeleton("scale 2^-2")  # a scale is text, not a tolerance
    assert differences("a 1.2e-05 b\n", "a 1.1e-05 b\n") == []
    assert differences("a 17 b\n", "a 18 b\n") == ["line 1: 17 in the docs, 18 today"]
    assert differences("a\nb\n", "a\n") == ["2 lines in the docs, 1 printed today"]
