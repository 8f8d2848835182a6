"""Facts in, words out: the judge's scale history is codes and figures, the words are written from them (in the run's
steps), and a rule decides on data (a device's missing kernel, the scaler's growth interval), never on a sentence."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, get_args

import pytest

from ampdoctor.input.config import TriageConfig
from ampdoctor.judge import context, detectors, rules, rules_silent, rules_target, scale_facts
from ampdoctor.judge import scaler as judge
from ampdoctor.records import StageError, StageResult
from ampdoctor.report import scaler as worded
from ampdoctor.report.build import stage_summary
from ampdoctor.report.words import diagnosis as diagnosis_words
from ampdoctor.report.words import scaler as scaler_words

from .test_rules import FALLING, FLAT, N, batches, ctx, no_recheck, rec, row, stage, stats, three
from .test_scaler import simulate

HISTORIES = {
    "calibrating": simulate(300, ceiling=2.0**14, init=2.0**16, gi=2000),
    "climbing": simulate(60, ceiling=1e9, init=1024.0, gi=10),
    "oscillating": simulate(400, ceiling=2.0**12 * 1.5, init=1024.0, gi=20),
    "collapsed": ([65536.0 * 0.5**i for i in range(30)], [True] * 30),
    "stable": ([1024.0] * 50, [False] * 50),
}


def _strings(x: Any) -> list[str]:
    """Every str inside a fact structure (dataclasses, lists, tuples, dicts)."""
    if isinstance(x, str):
        return [x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [s for f in dataclasses.fields(x) for s in _strings(getattr(x, f.name))]
    if isinstance(x, dict):
        return [s for k, v in x.items() for s in _strings(k) + _strings(v)]
    if isinstance(x, (list, tuple)):
        return [s for v in x for s in _strings(v)]
    return []


@pytest.mark.parametrize("name", sorted(HISTORIES))
def test_the_judge_returns_codes_and_figures_and_the_words_are_written_from_them(name: str) -> None:
    scales, skipped = HISTORIES[name]
    facts = judge.diagnose_scale(scales, skipped)
    assert facts.pattern == name
    codes = set(get_args(scale_facts.Pattern)) | set(get_args(scale_facts.AdviceCode)) | {"init_scale", "growth_interval", "backoff_factor"}
    assert set(_strings(facts)) <= codes, "no sentence in the judge's facts"
    d = worded.diagnose_scale(scales, skipped)
    assert d.explanation == scaler_words.explain(facts.finding) and d.explanation
    assert d.recommendations == [scaler_words.advise(a) for a in facts.advice]
    assert (d.pattern, d.settings, d.growths, d.min_scale) == (facts.pattern, facts.settings, facts.growths, facts.min_scale)


def test_every_advice_code_has_words() -> None:
    for code in get_args(scale_facts.AdviceCode):
        s = scaler_words.advise(scale_facts.Advice(code, 4096.0, current=0.5, count=3, step=7, steps=(1, 2)))
        assert s and "{" not in s, code
    assert worded.no_scale_history().explanation == "no GradScaler: no scale history"
    assert worded.diagnose_scale([], []).explanation == "no steps were recorded"


def test_the_scaler_story_is_told_in_the_run_steps_at_a_replay() -> None:
    """A replay from step 5000: the isolated skip of its step 3 is the run's step 5003 in the story's sentence."""
    amp = StageResult("amp", records=[rec(i, v, scale=1024.0, skipped=i == 3) for i, v in enumerate(FALLING)],
                      stats=[stats(i) for i in range(N)])
    res = three(amp=amp)
    c = context.Ctx(res, batches(), TriageConfig(steps=N), no_recheck, "cpu", step0=5000)
    assert c.scale is not None and c.scale.later_skips == [5003] and c.story is not None
    assert c.story.explanation == "", "the judge writes no words"
    d = rules.diagnose(res, batches(), TriageConfig(steps=N), no_recheck, step0=5000)
    _, _, _, story = diagnosis_words.write(rules.shift_diagnosis(d, 5000))
    assert story is not None and story.explanation == (
        "The scale stayed at 2^10 with 1 isolated skip(s). Isolated skips at steps 5003: check those batches.")


def test_a_stopped_stage_says_the_run_step_without_reading_the_engine_sentence() -> None:
    weights = StageResult("fp16", records=[rec(0), rec(1), rec(2, params_finite=False)],
                          stopped="weights became non-finite at step 2")
    s = stage_summary(weights, None, 7000)
    assert (s.stopped, s.first_nonfinite_step) == ("weights became non-finite at step 7002", 7002)
    loss = StageResult("fp16", records=[rec(0), rec(1, math.inf)], stopped="(the engine's own words)")
    assert stage_summary(loss, None, 40).stopped == "loss became non-finite at step 41"
    assert stage_summary(loss, None).stopped == "loss became non-finite at step 1"
    skipped = StageResult("amp", records=[rec(0), rec(1, skipped=True, scale=8.0)])
    assert (stage_summary(skipped, None, 10).skipped_steps, stage_summary(skipped, None, 10).stopped) == ([11], None)


def test_a_device_limit_is_decided_on_the_exception_not_on_the_hint() -> None:
    onednn = StageError("RuntimeError", "could not create a primitive descriptor for a matmul primitive", 1, "enc",
                        "the stage stopped at this exception")
    worded_only = StageError("RuntimeError", "shape mismatch", 1, "enc", "a device limitation, not a NaN cause")
    assert detectors.device_limited(onednn, "amp", "cpu") and not detectors.device_limited(onednn, "amp", "cuda:0")
    assert not detectors.device_limited(onednn, "bf16", "cpu")
    assert not detectors.device_limited(worded_only, "amp", "cpu"), "the hint's words decide nothing"
    out = rules_target.target_raised(ctx(three(amp=stage("amp", error=worded_only))))
    assert out is not None and out.cause == "amp_misuse" and out.facts["device_limit"] is False


def test_the_growth_estimate_uses_the_configured_growth_interval() -> None:
    flushed = {"enc.weight": row(), "head.weight": row(zero=4)}
    amp = stage("amp", FLAT, stats_at={i: stats(i, pgrad=flushed) for i in range(N)})
    tiny = {"enc.weight": row(absmax=1e-6), "head.weight": row(absmax=1e-6)}
    fp32 = stage("fp32", FALLING, stats_at={i: stats(i, pgrad=tiny) for i in range(N)})
    steps = {}
    for gi in (100, 2000):
        c = context.Ctx(three(amp=amp, fp16=stage("fp16", FLAT), fp32=fp32), batches(),
                      TriageConfig(steps=N, growth_interval=gi), no_recheck, "cpu")
        out = rules_silent.stall(c)
        assert out is not None and out.fixes[0].code == "raise_init_scale"
        k = out.fixes[0].facts["exponent"]
        steps[gi] = out.fixes[0].facts["growth_steps"]
        assert steps[gi] == (k - 16) * gi  # from 2^16, one doubling every growth_interval clean steps
    assert steps[100] * 20 == steps[2000]


def test_the_kernel_a_device_lacks_is_a_code() -> None:
    assert detectors.kernel_limit("could not create a primitive descriptor", "fp16", "cpu") == "onednn_fp16"
    assert detectors.kernel_limit("\"addmm_impl_cpu_\" not implemented for 'Half'", "bf16", "cuda") == "no_half_kernel"
    assert detectors.kernel_limit("oneDNN error", "bf16", "cpu") is None
