"""A captured ``exploding_update`` that FP32 shares is ``model_bug`` ("fails in FP32 too"): triage applies the
Monitor's own definition of an exploding update (``judge.scaler.explodes``: an applied gradient norm 1000x the median
of the last applied ones, judged once 8 are there) to the FP32 stage's applied steps, and when FP32 explodes at or
before the captured step the failure does not depend on the precision. The MLP whose warm-up ends 1000x too high is
in the late zoo (tests/test_late_zoo.py); here a conv net under a step schedule written backwards (gamma=10), and its
twin: the same capture replayed with clipping (``--max-norm 1.0``), where FP32 does not explode and the rule stays
silent."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest
import torch

from ampdoctor import Monitor, triage
from ampdoctor.capture.trigger import FailingStep
from ampdoctor.input.config import TriageConfig
from ampdoctor.judge.explosion import EXPLODE_HISTORY, EXPLODE_RATIO, explodes, first_explosion

SPEC = Path(__file__).parent / "diverge" / "conv_steplr.py"


def _capture(cap: Path) -> tuple[int, Path]:
    """The user's loop (autocast, GradScaler's defaults, the schedule set each step) until the Monitor's first failure."""
    ns = runpy.run_path(str(SPEC))
    model = ns["build_model"]()
    opt = ns["build_optimizer"](model.parameters())
    g = torch.Generator().manual_seed(1)
    with Monitor(model, opt, torch.amp.GradScaler("cpu"), capture=cap, snapshot_every=20, quiet=True) as mon:
        for step in range(200):
            for group in opt.param_groups:
                group["lr"] = ns["lr_at"](step)
            x, y = ns["batch"](step, g)
            with mon.autocast():
                loss = ns["loss_fn"](model(x), y)
            rec = mon.step(loss, batch=(x, y))
            if rec.capture and mon.first_failure is not None:
                return mon.first_failure[0], Path(rec.capture)
    raise AssertionError("no failure in 200 steps")


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    return _capture(tmp_path_factory.mktemp("conv") / "cap")


@pytest.mark.slow
def test_an_exploding_update_fp32_shares_is_a_model_bug(captured: tuple[int, Path]) -> None:
    step, cap = captured
    m = json.loads((cap / "manifest.json").read_text())
    assert (step, m["reason"], m["snapshot_step"]) == (73, "exploding_update", 60)  # lr 10 from step 60
    report, _ = triage(SPEC, from_capture=cap)
    v = report.verdict
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT" and v.cause != "model_bug":
        # known: under PyTorch's scalar kernels the replay of this chaotic run (lr 10 with momentum) takes another
        # path: the amp stage's gradients overflow at step 62 and FP32 does not explode by step 73; the model needs a
        # sharper divergence (said in issue 45's closing note)
        pytest.xfail(f"scalar kernels: the replay says {v.cause} at step {v.first_step}")
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("model_bug", None, 73, "fp32"), v.summary
    assert "FP32 diverges too: its update at step 73" in v.summary and "captured at step 73" in v.summary
    assert "with every value finite" in v.summary
    ev = report.findings[0].evidence
    assert ev["grad_l2"] >= EXPLODE_RATIO * ev["median_grad_l2_before"] and ev["applied_steps_before"] == 13
    assert math.isfinite(ev["fp32_max_loss"]) and ev["fp32_max_loss"] > 1e12
    fixes = " ".join(report.fixes)
    assert "learning rate the schedule reaches by step 73" in fixes and "--max-norm 1.0" in fixes
    assert "scale of the objective" in fixes


@pytest.mark.slow
def test_the_same_capture_with_clipping_does_not_explode_in_fp32(captured: tuple[int, Path]) -> None:
    # the twin: replayed with --max-norm 1.0, FP32's applied norms stay within 1000x their median: not this rule
    _, cap = captured
    report, _ = triage(SPEC, from_capture=cap, config=TriageConfig(max_norm=1.0))
    assert report.verdict.cause == "healthy", report.verdict.summary


def test_the_definition_is_the_monitors() -> None:
    # median of the first 8: 1.75, so 1800 (1029x) explodes; then the median is 2: 1999 does not, 2000 (1000x) does
    norms = [1.0, 2.0, 0.5, 3.0, 1.5, 2.5, 1.0, 2.0, 1800.0, 1999.0, 2000.0]
    rule, monitor = FailingStep(), []
    for n in norms:
        t = rule.judge(skipped=False, reason="", scale=1024.0, alert=False, norm=n)
        monitor.append(t is not None and t.reason == "exploding_update")
    triage_says = [explodes(n, norms[:i]) for i, n in enumerate(norms)]
    assert triage_says == monitor == [False] * 8 + [True, False, True]
    assert first_explosion([(s, n, False) for s, n in enumerate(norms)]).step == 8  # type: ignore[union-attr]


def test_first_explosion_counts_only_applied_steps() -> None:
    few = [(s, 1.0, False) for s in range(EXPLODE_HISTORY - 1)] + [(7, 1e9, False)]
    assert first_explosion(few) is None  # 7 applied norms before it: nothing to compare with
    steps = [(s, 1.0, False) for s in range(8)] + [(8, 1e6, True), (9, 999.0, False), (10, 1000.0, False)]
    ex = first_explosion(steps)
    assert ex is not None and (ex.step, ex.norm, ex.typical, ex.history) == (10, 1000.0, 1.0, 9)
    assert first_explosion([(s, 1.0, False) for s in range(8)] + [(8, math.inf, False), (9, 999.0, False)]) is None
