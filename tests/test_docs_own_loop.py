"""docs/own-loop.md: its examples run, in order, and print what the page says they print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ampdoctor.watch.steplog_read import read_step_log

DOC = Path(__file__).resolve().parent.parent / "docs" / "own-loop.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_own_loop_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code = blocks("python")
    assert len(code) == 2
    monkeypatch.chdir(tmp_path)
    exec(compile(code[0], "own-loop.md#1", "exec"), {"__name__": "__doc_example__"})
    first = capsys.readouterr().out
    exec(compile(code[1], "own-loop.md#2", "exec"), {"__name__": "__doc_example__"})
    second = capsys.readouterr().out
    log = read_step_log(tmp_path / "steps.csv")
    assert log.steps == list(range(80))
    assert [s for s, k in zip(log.steps, log.skipped, strict=True) if k] == [30]
    if not torch.cuda.is_available():  # the page shows the CPU run's output
        shown = re.search(r"On the CPU it prints:\n\n```\n(.*?)```", DOC.read_text(), flags=re.S)
        assert shown is not None
        shown = shown.group(1)
        assert first == shown
        assert "It prints `" + second.strip() + "`" in DOC.read_text()
