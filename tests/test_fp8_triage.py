"""``ampdoctor triage SAMPLE --target fp8``: each FP8 sample names its cause, Linear, operand and step.

The runs need torchao (``pip install ampdoctor[fp8]``); the rules' own tests below do not.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.formats import FP8_E4M3
from ampdoctor.judge.fp8 import Fp8Ladder, RungRun, judge
from ampdoctor.scaled import GemmRow, as_dict, operand_stats

from .conftest import SAMPLES

EXPECTED = {
    # sample: (cause, module, operand, step, exit code)
    "fp8_healthy.py": ("healthy", None, None, None, 0),
    "fp8_outlier_row.py": ("fp8_flush", "0", "input", 0, 1),
    "fp8_grad_underflow.py": ("fp8_grad_underflow", "head", "grad_output", 0, 1),
    "fp8_degenerate_scale.py": ("fp8_degenerate_scale", "0.lora_b", "weight", 0, 1),
    "fp8_precision_loss.py": ("fp8_precision_loss", "0", "grad_output", None, 1),
}


@pytest.fixture(autouse=True)
def _torchao_floor_kept():
    """fp8_degenerate_scale.py removes torchao's amax floor when it is imported (in this process): put it back."""
    fu = sys.modules.get("torchao.float8.float8_utils")
    eps = getattr(fu, "EPS", None)
    yield
    fu = sys.modules.get("torchao.float8.float8_utils")
    if fu is not None:
        fu.EPS = eps if eps is not None else 1e-12


def _triage(sample: str, *extra: str) -> tuple[int, dict]:
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / sample), "--target", "fp8", "--json", "-", *extra])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


@pytest.mark.fp8
@pytest.mark.parametrize("sample", [pytest.param(s, marks=pytest.mark.slow) if s == "fp8_precision_loss.py" else s
                                    for s in sorted(EXPECTED)])
def test_fp8_sample_verdict(sample: str) -> None:  # fp8_precision_loss.py: 150 steps a rung, in CI's -m slow
    pytest.importorskip("torchao")
    cause, module, operand, step, code = EXPECTED[sample]
    rc, rep = _triage(sample)
    assert (rep["cause"], rep["module"], rep["operand"], rc) == (cause, module, operand, code), rep["summary"]
    if step is not None:
        assert rep["step"] == step
    assert [r["rung"] for r in rep["rungs"]] == ["fp32", "bf16", "fp8"]
    assert rep["summary"]
    if cause != "healthy":
        assert rep["fixes"] and any(module in f for f in rep["fixes"]), "every problem names the Linear to change"
    if cause == "fp8_precision_loss":
        assert rep["facts"]["fp8_loss"] > 10 * rep["facts"]["bf16_loss"]
        assert rep["step"] > 0


@pytest.mark.fp8
def test_rowwise_keeps_the_outlier_rows() -> None:
    """The fix the outlier-row verdict gives: with one scale per row nothing flushes."""
    pytest.importorskip("torchao")
    _, rep = _triage("fp8_outlier_row.py", "--fp8-recipe", "rowwise")
    assert rep["cause"] != "fp8_flush"
    assert all(g["flushed"] < 0.01 for g in rep["gemms"])


@pytest.mark.fp8
def test_fp8_healthy_in_the_terminal_80_columns() -> None:
    pytest.importorskip("torchao")
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / "fp8_healthy.py"), "--target", "fp8", "--steps", "8"],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "ampdoctor verdict: healthy" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80


def test_without_torchao_one_line_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 raises ImportError
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / "fp8_healthy.py"), "--target", "fp8", "--steps", "4"])
    assert res.exit_code == 2
    assert "pip install 'ampdoctor[fp8]'" in res.output and "Traceback" not in res.output


def test_options_fp8_does_not_take_yet_are_one_line() -> None:
    res = CliRunner().invoke(app, ["triage", str(SAMPLES / "fp8_healthy.py"), "--target", "fp8", "--stages", "fp16"])
    assert res.exit_code == 2 and "--stages does not work with --target fp8" in res.output


# the rules on real statistics (no torchao) ---------------------------------------------------------

def _ladder(rows: list[GemmRow], fp8_losses: list[float] | None = None) -> Fp8Ladder:
    base = [1.0, 0.8, 0.6, 0.5, 0.4, 0.35, 0.3, 0.28]
    f8 = list(fp8_losses or base)
    return Fp8Ladder({"fp32": RungRun("fp32", list(base), [1.0] * len(base)),
                      "bf16": RungRun("bf16", list(base), [1.0] * len(base)),
                      "fp8": RungRun("fp8", f8, [1.0 if math.isfinite(v) else math.nan for v in f8], gemms=rows)},
                     "tensorwise", "cpu", True)


def _row(step: int, module: str, operand: str, x: torch.Tensor, scale: torch.Tensor | None = None) -> GemmRow:
    return GemmRow(step, module, operand, "fp8_e4m3", False, as_dict(operand_stats(x, FP8_E4M3, scale=scale)))


def test_a_stale_scale_is_saturation() -> None:
    """An activation that doubled since its amax was taken (a delayed scale): the top values saturate at 448."""
    g = torch.Generator().manual_seed(0)
    before = torch.randn(64, 32, generator=g)
    now = 2 * before
    stale = torch.tensor(448.0) / before.abs().amax()
    rows = [_row(0, "fc1", "input", before), _row(1, "fc1", "input", now, scale=stale)]
    out = judge(_ladder(rows))
    assert (out.cause, out.module, out.step, out.facts["operand"]) == ("fp8_saturation", "fc1", 1, "input")
    assert out.facts["saturated"] == float(((now * stale).abs() >= 464).sum()) / now.numel() > 0


def test_dynamic_scales_are_healthy_and_flush_needs_the_tolerance() -> None:
    """The same tensors with their own (dynamic) scales: nothing saturates; a sparse flush below 1% is no verdict."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    x[0, 0] = 1e6  # one element 1e6 x: flushes the elements below 1e6 * 2^-10 / 448 of the others, a few of 2048
    x[1:, :] *= 1e-3
    rows = [_row(s, "fc1", "input", x * (s + 1)) for s in range(8)]
    fl = rows[0].stats["flushed"]
    out = judge(_ladder(rows))
    assert (out.cause == "fp8_flush") == (fl >= 0.01)
    rows_small = [_row(s, "fc1", "input", torch.randn(64, 32, generator=g)) for s in range(8)]
    assert judge(_ladder(rows_small)).cause == "healthy"


def test_bf16_failing_first_is_not_an_fp8_verdict() -> None:
    lad = _ladder([])
    lad.rungs["bf16"].losses[3] = math.nan
    lad.rungs["bf16"].grad_norms[3] = math.nan
    out = judge(lad)
    assert (out.cause, out.stage, out.step) == ("bf16_failure", "bf16", 3)


@pytest.mark.fp8
def test_the_flushed_gradients_freeze_the_auxiliary_output() -> None:
    """What the grad-underflow verdict costs: BF16 trains the head's auxiliary row (its gradients are above AdamW's
    eps), FP8 gives it no gradient (only weight decay moves it)."""
    pytest.importorskip("torchao")
    import copy
    import importlib.util

    from ampdoctor.ladder.fp8 import Float8Transform

    spec = importlib.util.spec_from_file_location("fp8_grad_underflow", SAMPLES / "fp8_grad_underflow.py")
    s = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(s)  # type: ignore[union-attr]
    torch.manual_seed(0)
    m = s.build_model()
    data = s.build_dataloader()
    moved = {}
    for name, mm in (("bf16", copy.deepcopy(m)), ("fp8", Float8Transform().apply(copy.deepcopy(m), torch.device("cpu")))):
        w0 = mm.head.weight.detach().clone()
        opt = torch.optim.AdamW(mm.parameters(), lr=1e-3)
        for step in range(20):
            x, y = data[step % len(data)]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = s.loss_fn(mm(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        moved[name] = (mm.head.weight.detach() - w0).norm(dim=1)
    decay_only = 20 * 1e-3 * 1e-2 * float(m.head.weight[1].detach().norm())  # lr * weight_decay * |w| a step, at most
    assert float(moved["bf16"][1]) > 10 * decay_only
    assert float(moved["fp8"][1]) <= 1.01 * decay_only


def test_the_fp8_rung_is_registered() -> None:
    """``--target fp8`` runs registered rungs: fp8 is BF16 autocast, FP32 weights, the recipe's Float8 transform."""
    from ampdoctor.input.config import TriageConfig
    from ampdoctor.ladder import registered, rung
    from ampdoctor.ladder.fp8 import LADDER

    assert set(LADDER) <= set(registered())
    r = rung("fp8", TriageConfig(fp8_recipe="rowwise"))
    assert (r.compute, r.params, r.scaler) == (torch.bfloat16, torch.float32, False)
    assert r.describe()["transform"] == {"name": "float8:rowwise", "recipe": "rowwise", "skip": [], "emulate": None}
