"""Every verdict rule on synthetic records (no model runs): its cause, module, step, stage and key
facts; and every cause, verdict variant, finding code and fix code has words."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ampdoctor.input.batches import Batches
from ampdoctor.input.config import TriageConfig
from ampdoctor.judge import context, refine, rules, rules_fp32, rules_silent, rules_target
from ampdoctor.judge.context import Ctx, Recheck
from ampdoctor.judge.opscan import NonfiniteOp, OpRecord
from ampdoctor.judge.rules import diagnose, shift_diagnosis
from ampdoctor.records import NCOLS, Call, Col, Finding, Outcome, StageError, StageResult, StepRecord, StepStats, UserHook
from ampdoctor.report.model import CAUSES
from ampdoctor.report.words import diagnosis as diagnosis_words
from ampdoctor.report.words import findings as findings_words
from ampdoctor.report.words import fixes as fixes_words
from ampdoctor.report.words import verdicts as verdicts_words

NAN, INF = float("nan"), float("inf")
N = 8
"""Steps per synthetic stage: enough for the stall rule (MIN_STALL_STEPS)."""


# synthetic records ------------------------------------------------------------------------------
def row(numel: int = 4, nan: int = 0, zero: int = 0, absmax: float = 1.0, overflow: int = 0) -> np.ndarray:
    r = np.zeros(NCOLS)
    r[Col.NUMEL], r[Col.NAN], r[Col.ZERO], r[Col.OVERFLOW] = numel, nan, zero, overflow
    r[Col.NORMAL] = numel - nan - zero - overflow
    r[Col.ABSMAX], r[Col.MIN_NONZERO] = absmax, 1.0
    return r


def stats(step: int, *, fwd: str | None = None, root: bool = False, bwd: str | None = None, absmax: float = 1.0,
          pgrad: dict[str, np.ndarray] | None = None) -> StepStats:
    """A model ``<model>`` = head(enc(x)): tensor 0 is the input, 1 enc's output, 2 head's (the model's).

    ``fwd``: the module whose output turns non-finite; ``root``: the root's own code does (children finite);
    ``bwd``: the module whose input gradient turns non-finite in backward.
    """
    st = StepStats(step, calls=[Call("enc", [0], [1]), Call("head", [1], [2]), Call("<model>", [0], [2])],
                   model_inputs=[0], model_outputs=[2], grad_order=[2, 1, 0])
    bad1, bad2 = fwd == "enc", fwd in ("enc", "head") or root
    st.act = {0: row(), 1: row(nan=int(bad1), absmax=absmax), 2: row(nan=int(bad2), absmax=absmax)}
    st.grad = {2: row(), 1: row(nan=int(bwd == "head")), 0: row(nan=int(bwd in ("enc", "head")))}
    st.pgrad = pgrad if pgrad is not None else {"enc.weight": row(), "head.weight": row()}
    if root:
        st.calls = [Call("enc", [0], [1]), Call("head", [1], [3]), Call("<model>", [0], [2])]
        st.act[3] = row()
    return st


def rec(step: int, loss: float = 1.0, *, grad: float = 1.0, skipped: bool = False, scale: float | None = None,
        params_finite: bool = True) -> StepRecord:
    return StepRecord(step, step, 1e-3, loss, grad, grad, skipped, "inf/nan gradient" if skipped else "", scale, params_finite)


def stage(name: str, losses: list[float] | None = None, *, stats_at: dict[int, StepStats] | None = None,
          **kw: Any) -> StageResult:
    """A stage of N steps (losses default 1.0, falling in FP32), with the given stats per step."""
    losses = losses or [1.0] * N
    scale = 65536.0 if name == "amp" else None
    records = [rec(i, v, scale=scale) for i, v in enumerate(losses)]
    sts = [(stats_at or {}).get(i) or stats(i) for i in range(len(losses))]
    return StageResult(name, records=records, stats=sts, **kw)


FALLING = [10.0 - i for i in range(N)]
FLAT = [10.0] * N


def batches(n: int = N, *, nan_at: int | None = None, big_at: int | None = None) -> Batches:
    items = []
    for i in range(n):
        x = torch.ones(4, 3)
        if i == nan_at:
            x[1, 0] = NAN
        if i == big_at:
            x[2, 1] = 1e7
        items.append((x, torch.zeros(4)))
    return Batches(items, cycled=False)


def no_recheck(stage: str, step: int) -> Recheck | None:
    return None


def ctx(results: dict[str, StageResult], *, target: str = "amp", data: Batches | None = None,
        recheck: Callable[[str, int], Recheck | None] = no_recheck, hooks: list[str] | None = None,
        hook_list: list[UserHook] | None = None, hook_check: context.HookCheckFn | None = None,
        captured: tuple[str, int] | None = None) -> Ctx:
    return Ctx(results, data or batches(), TriageConfig(steps=N, target=target), recheck, "cpu", hooks,
               hook_list=hook_list, hook_check=hook_check, captured=captured)


def three(amp: StageResult | None = None, fp16: StageResult | None = None, fp32: StageResult | None = None) -> dict[str, StageResult]:
    return {"fp32": fp32 or stage("fp32", FALLING), "fp16": fp16 or stage("fp16", FALLING),
            "amp": amp or stage("amp", FALLING)}


def with_record(res: StageResult, step: int, **kw: Any) -> StageResult:
    r = res.records[step]
    res.records[step] = rec(step, kw.pop("loss", r.loss), scale=r.scaler_scale, **kw)
    return res


# one scenario per rule: (rule, context, (cause, module, step, stage), key facts) ----------------
Scenario = tuple[context.Rule, Ctx, tuple[str, str | None, int | None, str | None], dict[str, Any]]


def _fp32_raised() -> Scenario:
    fp32 = stage("fp32", error=StageError("ValueError", "shapes do not match", 3, "enc", ""))
    return rules_fp32.fp32_raised, ctx(three(fp32=fp32)), ("model_bug", "enc", 3, "fp32"), {"type": "ValueError"}


def _fp32_nonfinite_data() -> Scenario:
    fp32 = with_record(stage("fp32", FALLING), 2, loss=NAN)
    return (rules_fp32.fp32_nonfinite_data, ctx(three(fp32=fp32), data=batches(nan_at=2)), ("data", None, 2, "fp32"),
            {"field": "inputs", "count": 1, "samples": [1]})


def _fp32_outlier() -> Scenario:
    fp32 = with_record(stage("fp32", FALLING), 5, loss=INF)
    return (rules_fp32.fp32_outlier, ctx(three(fp32=fp32), data=batches(big_at=5)), ("data", None, 5, "fp32"),
            {"field": "inputs", "ratio": 1e7, "samples": [2]})


def _fp32_model_bug() -> Scenario:
    fp32 = stage("fp32", [NAN] + FALLING[1:], stats_at={0: stats(0, fwd="enc")})
    c = ctx(three(fp32=fp32), recheck=lambda s, k: Recheck(NAN, False, "initial"))
    return rules_fp32.fp32_model_bug, c, ("model_bug", "enc", 0, "fp32"), {"variant": "fp32_bug", "location": "module"}


def _fp32_diverged() -> Scenario:
    fp32 = stage("fp32", FALLING[:6] + [NAN, NAN], stats_at={6: stats(6, bwd="head")})
    c = ctx(three(fp32=fp32), recheck=lambda s, k: Recheck(2.0, True, "initial"))
    return rules_fp32.fp32_model_bug, c, ("model_bug", "head", 6, "fp32"), {"variant": "fp32_diverged", "steps_before": 6}


def _fp32_exploded() -> Scenario:
    # a replayed exploding_update (captured at step 9): FP32's applied norm at 8 is 1000x the median of the 8 before it
    losses = [10.0 - i for i in range(8)] + [50.0, 1e6]
    fp32, fp16, amp = (stage(n, losses) for n in ("fp32", "fp16", "amp"))
    fp32.records[8] = rec(8, 50.0, grad=1000.0)
    c = ctx({"fp32": fp32, "fp16": fp16, "amp": amp}, data=batches(10), captured=("exploding_update", 9))
    return (rules_fp32.fp32_exploded, c, ("model_bug", None, 8, "fp32"),
            {"variant": "fp32_exploded", "typical": 1.0, "history": 8, "captured_step": 9, "max_loss": 1e6})


def _no_target() -> Scenario:
    return rules_target.no_target, ctx({"fp32": stage("fp32", FALLING)}), ("healthy", None, None, None), {"variant": "no_target"}


def _custom_function() -> Scenario:
    err = StageError("RuntimeError", "expected both to have the same dtype, but got: c10::Half != float", 0, "enc", "", "MatMul")
    return (rules_target.custom_function, ctx(three(amp=stage("amp", error=err))), ("amp_misuse", "enc", 0, "amp"),
            {"function": "MatMul", "device": "cpu"})


def _target_raised() -> Scenario:
    err = StageError("NotImplementedError", "\"addmm_impl_cpu_\" not implemented for 'Half'", 1, "enc", "a device limitation: rerun on a GPU")
    return (rules_target.target_raised, ctx(three(amp=stage("amp", error=err))), ("inconclusive", "enc", 1, "amp"),
            {"device_limit": True})


def _target_raised_fill() -> Scenario:
    # masked_fill(mask, -1e9) on FP16 scores: the stage raises; judge.refine (in diagnose) makes it the forward overflow
    # it is, from the FP32 op scan's masked_fill reaching 1e9 (variant fill_beyond)
    err = StageError("RuntimeError", "value cannot be converted to type c10::Half without overflow", 1, "attn", "")

    def recheck(stage: str, step: int) -> Recheck:
        return Recheck(1.0, True, "initial", ops=lambda m: [OpRecord(0, "masked_fill", 1e9, 0.25, 16)])

    return (rules_target.target_raised, ctx(three(amp=stage("amp", error=err)), recheck=recheck),
            ("amp_misuse", "attn", 1, "amp"), {"device_limit": False})


def _outlier_at_event() -> Scenario:
    amp = with_record(stage("amp", FALLING), 3, skipped=True)
    return (rules_target.outlier_at_event, ctx(three(amp=amp), data=batches(big_at=3)), ("data", None, 3, "amp"),
            {"step": 3, "batch": 3, "field": "inputs"})


def _damaged_weights() -> Scenario:
    amp = with_record(stage("amp", FALLING), 2, loss=NAN)
    c = ctx(three(amp=amp), recheck=lambda s, k: Recheck(NAN, False, f"stage {s} before step {k}"))
    return rules_target.damaged_weights, c, ("amp_misuse", None, 2, "amp"), {"why": "damaged"}


def _forward_in_root() -> Scenario:
    amp = stage("amp", [NAN] + FALLING[1:], stats_at={0: stats(0, root=True)})
    op = NonfiniteOp("exp", "<model>", "spec.py:13")
    c = ctx(three(amp=amp), recheck=lambda s, k: Recheck(3.0, True, "stage amp before step 0", None, lambda: op))
    return rules_target.forward_in_root, c, ("fp16_forward_overflow", None, 0, "amp"), {"place": "root", "op": "exp"}


def _loss_in_fp16() -> Scenario:
    amp = with_record(stage("amp", FALLING), 1, loss=INF)
    return rules_target.loss_in_fp16, ctx(three(amp=amp)), ("fp16_forward_overflow", None, 1, "amp"), {"place": "loss", "op": None}


def _forward_overflow() -> Scenario:
    amp = stage("amp", [NAN] + FALLING[1:], stats_at={0: stats(0, fwd="enc")})
    fp32 = stage("fp32", FALLING, stats_at={0: stats(0, absmax=9e4)})
    return (rules_target.forward_overflow, ctx(three(amp=amp, fp32=fp32)), ("fp16_forward_overflow", "enc", 0, "amp"),
            {"fp32_absmax": 9e4})


def _grad_overflow() -> Scenario:
    fp16 = with_record(stage("fp16", FALLING), 0, grad=INF)  # raw FP16 overflows too: a range problem
    amp = with_record(stage("amp", FALLING, stats_at={4: stats(4, bwd="head")}), 4, grad=INF, skipped=False)
    amp.records[4].params_finite = False
    return (rules_target.grad_overflow, ctx(three(amp=amp, fp16=fp16), target="amp"), ("fp16_grad_overflow", "head", 4, "amp"),
            {"how": "nonfinite"})


def _grad_overflow_probe_clean() -> Scenario:
    # AMP skips while raw FP16 (no scaling) is clean, and a gradient hook on the model handles the scaled gradients:
    # that hook is the evidence amp_misuse names
    amp = with_record(stage("amp", FALLING, stats_at={4: stats(4, bwd="head")}), 4, grad=INF)
    amp.records[4].params_finite = False
    c = ctx(three(amp=amp))
    c.hooks = ["head.weight: grad hook clamp_grad"]
    return rules_target.grad_overflow, c, ("amp_misuse", None, 4, "amp"), {"why": "probe_clean"}


def _grad_overflow_probe_clean_no_evidence() -> Scenario:
    # the same skip with nothing that touches the scaled gradients: GradScaler overflowing times its scale and
    # backing off is its normal working, not AMP misuse
    amp = with_record(stage("amp", FALLING, stats_at={4: stats(4, bwd="head")}), 4, grad=INF)
    amp.records[4].params_finite = False
    return rules_target.grad_overflow, ctx(three(amp=amp)), ("healthy", "head", 4, "amp"), {"variant": "scaler_normal"}


def _nonfinite_weights() -> Scenario:
    fp16 = with_record(stage("fp16", FALLING, master_weights=False), 5, params_finite=False)
    return (rules_target.nonfinite_weights, ctx(three(fp16=fp16), target="fp16"), ("fp16_update_swallowed", None, 5, "fp16"),
            {"variant": "swallowed"})


def _masked_overflow() -> Scenario:
    flushed = {"enc.weight": row(zero=4), "head.weight": row()}
    amp = stage("amp", FALLING, stats_at={0: stats(0, pgrad=flushed)})
    return (rules_silent.masked_overflow, ctx(three(amp=amp), hooks=["gradient hook on parameter enc.weight"]),
            ("amp_misuse", None, 0, "amp"), {"why": "masked", "parameter": "enc.weight", "scaled": 65536.0})


NAN_TO_NUM = UserHook("gradient hook", "parameter", "head.weight", "spec.build_model.<locals>.<lambda>", "spec.py:9",
                      ["nan_to_num"])


def _hook_hid_overflow() -> Scenario:
    # the hook on head.weight was handed a non-finite gradient at step 3, GradScaler applied the step, and from the
    # ruined weights FP32 fails too at step 4: the hook is the cause, not a model bug
    amp = stage("amp", FALLING, hook_inputs_nonfinite={3: ["head.weight"]})
    fp32 = with_record(stage("fp32", FALLING), 4, loss=INF)
    c = ctx(three(amp=amp, fp32=fp32), hooks=[NAN_TO_NUM.describe()], hook_list=[NAN_TO_NUM])
    return (rules_fp32.hook_hid_overflow, c, ("amp_misuse", "head", 3, "amp"),
            {"variant": "hook_hid_overflow", "how": "probe", "param": "head.weight", "ops": ["nan_to_num"]})


def _hook_hid_overflow_replay() -> Scenario:
    # step 2 applied with a non-finite norm; replayed without the hooks, enc.weight's scaled gradient overflows
    amp = stage("amp", FALLING, applied_step=2)
    amp.records[2].grad_l2_pre_clip = INF
    hook = UserHook("gradient hook", "parameter", "enc.weight", "spec.clamp_hook", "spec.py:4", ["clamp"])

    def check(stage_name: str, step: int) -> context.HookCheck | None:
        return context.HookCheck(step, 65536.0, [], ["enc.weight"]) if (stage_name, step) == ("amp", 2) else None

    c = ctx(three(amp=amp), hooks=[hook.describe()], hook_list=[hook], hook_check=check)
    return (rules_fp32.hook_hid_overflow, c, ("amp_misuse", "enc", 2, "amp"),
            {"how": "replay_without_hooks", "param": "enc.weight", "hook": hook.describe()})


def _stall() -> Scenario:
    return (rules_silent.stall, ctx(three(fp16=stage("fp16", FLAT)), target="fp16"), ("fp16_grad_underflow", None, None, "fp16"),
            {"variant": "stall", "ratio": pytest.approx((9.5 - 10.0) / (9.5 - 3.5))})  # head/tail means of 2 steps


def _stall_underflow() -> Scenario:
    flushed = {"enc.weight": row(), "head.weight": row(zero=4)}
    amp = stage("amp", FLAT, stats_at={i: stats(i, pgrad=flushed) for i in range(N)})
    tiny = {"enc.weight": row(absmax=1e-6), "head.weight": row(absmax=1e-6)}  # x 65536 stays far below FP16's max
    fp32 = stage("fp32", FALLING, stats_at={i: stats(i, pgrad=tiny) for i in range(N)})
    c = ctx(three(amp=amp, fp16=stage("fp16", FLAT), fp32=fp32))
    return rules_silent.stall, c, ("fp16_grad_underflow", "head", None, "amp"), {"variant": "underflow", "param": "head.weight",
                                                                          "flushed": 1.0}


def _stall_amp() -> Scenario:
    return rules_silent.stall, ctx(three(amp=stage("amp", FLAT))), ("amp_misuse", None, None, "amp"), {"why": "stall"}


def _optimizer_underflow() -> Scenario:
    fp16 = stage("fp16", FALLING, master_weights=False, optimizer_underflow=["eps=1e-08"])
    return (rules_silent.optimizer_underflow, ctx(three(fp16=fp16), target="fp16"), ("fp16_update_swallowed", None, None, "fp16"),
            {"optimizer_underflow": ["eps=1e-08"]})


def _frozen() -> Scenario:
    flushed = {"enc.weight": row(zero=4), "head.weight": row()}
    fp16 = stage("fp16", FALLING, stats_at={i: stats(i, pgrad=flushed) for i in range(N)},
                 moved={"enc.weight": 0.1, "head.weight": 1.0})
    fp32 = stage("fp32", FALLING, moved={"enc.weight": 1.0, "head.weight": 1.0})
    return (rules_silent.frozen, ctx(three(fp16=fp16, fp32=fp32), target="fp16"), ("fp16_grad_underflow", "enc", None, "fp16"),
            {"variant": "frozen", "frozen": 1, "moved": pytest.approx(0.1)})


def _flushed_in_fp16() -> Scenario:
    # pure FP16: enc's gradient flushes at step 1 only (no stall, no movement lost, the median over steps is clean)
    sts = {1: stats(1, pgrad={"enc.weight": row(zero=4), "head.weight": row()})}
    fp16 = stage("fp16", FALLING, stats_at=sts)
    return (rules_silent.flushed_in_fp16, ctx(three(fp16=fp16), target="fp16"), ("fp16_grad_underflow", "enc", 1, "fp16"),
            {"variant": "flushed_step", "share": 1.0, "modules": 1})


def _beyond_range_batch() -> Scenario:
    # batch 3 holds 1e7 (beyond FP16's range); in FP32 it reaches enc's input at step 3, and on no other step
    st = stats(3)
    st.act[0] = row(overflow=1, absmax=1e7)
    fp32 = stage("fp32", FALLING, stats_at={3: st})
    return (rules_target.beyond_range_batch, ctx(three(fp32=fp32), data=batches(big_at=3)), ("data", None, 3, "amp"),
            {"field": "inputs", "position": [2, 1], "value": 1e7, "module": "enc", "count": 1})


def _healthy() -> Scenario:
    fp16 = with_record(stage("fp16", FALLING), 2, loss=INF)
    amp = stage("amp", FALLING)
    amp.records[0] = rec(0, FALLING[0], skipped=True, scale=65536.0)
    for r in amp.records[1:]:
        r.scaler_scale = 32768.0
    out_c = ctx(three(amp=amp, fp16=fp16))
    return (lambda c: rules.healthy(c)), out_c, ("healthy", None, None, "amp"), {"calibration_skips": 1}


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    f.__name__[1:]: f for f in (
        _fp32_raised, _fp32_nonfinite_data, _fp32_outlier, _fp32_model_bug, _fp32_diverged, _fp32_exploded, _no_target, _custom_function,
        _target_raised, _target_raised_fill, _outlier_at_event, _damaged_weights, _forward_in_root, _loss_in_fp16, _forward_overflow,
        _grad_overflow, _grad_overflow_probe_clean, _grad_overflow_probe_clean_no_evidence, _nonfinite_weights, _masked_overflow, _hook_hid_overflow,
        _hook_hid_overflow_replay, _stall, _stall_underflow,
        _stall_amp, _optimizer_underflow, _frozen, _flushed_in_fp16, _beyond_range_batch, _healthy)
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_rule(name: str) -> None:
    rule, c, want, facts = SCENARIOS[name]()
    out = rule(c)
    assert out is not None, f"{name}: the rule does not apply"
    assert (out.cause, out.module, out.step, out.stage) == want
    for k, v in facts.items():
        assert out.facts.get(k) == v, (k, out.facts)
    if out.cause != "healthy" and out.facts["variant"] != "no_target":
        f = out.findings[0]
        assert (f.code, f.module, f.stage) == (out.cause, out.module, out.stage) and f.title == "" and f.fix == ""


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_ordered_rules_give_the_same_verdict(name: str) -> None:
    """``judge`` (the ordered list) reaches each scenario's rule: no earlier rule claims it."""
    rule, c, want, _ = SCENARIOS[name]()
    out = rules.judge(c)
    assert (out.cause, out.module, out.step, out.stage) == want


def test_rules_do_not_apply_to_a_clean_run() -> None:
    c = ctx(three())
    assert [r.__name__ for r in rules.RULES if r(c) is not None] == []
    out = rules.judge(c)
    assert out.cause == "healthy" and out.findings == []


def test_healthy_warnings_are_data() -> None:
    _, c, _, _ = _healthy()
    out = rules.healthy(c)
    codes = {f.code: f for f in out.findings}
    assert codes["calibration_skips"].evidence["scales"] == [65536.0]
    assert codes["probe_nonfinite"].step == 2


def test_words_of_every_scenario() -> None:
    """Every scenario's verdict, findings and fixes in words: no raw code, no format braces, no blank."""
    seen_causes, seen_variants, seen_fixes = set(), set(), set()
    for name, make in SCENARIOS.items():
        _, c, *_ = make()
        d = diagnose(c.results, c.batches, c.cfg, c.recheck, "cpu", c.hooks, hook_list=c.hook_list, hook_check=c.hook_check,
                     captured=c.captured)
        seen_causes.add(d.outcome.cause)
        seen_variants.add(d.outcome.facts["variant"])
        seen_fixes |= {f.code for f in d.outcome.fixes}
        verdict, findings, fixes, _ = diagnosis_words.write(d)
        texts = [verdict.summary, *(f.title for f in findings), *fixes] + [f.fix for f in findings if f.fix]
        for t in texts:
            assert t and "{" not in t and t not in fixes_words.FIXES and t not in verdicts_words.SUMMARIES, (name, t)
        assert not any(k.startswith("_") for f in findings for k in f.evidence), name
    # the two verdicts of a replay that did not fail again (judge.rules.not_reproduced) are worded in
    # tests/test_model_settings.py and tests/test_capture.py; compile_numerics needs an Inductor compile:
    # tests/test_compile_rung.py
    assert seen_causes == set(CAUSES) - {"not_reproduced", "replay_mismatch", "compile_numerics"}
    assert seen_variants == set(verdicts_words.SUMMARIES) - {"not_reproduced", "replay_mismatch", "compile_numerics"}


def _codes_written(module: Any) -> dict[str, set[str]]:
    """What a rules module's code writes, read from its syntax tree (not its text): the constant code of every
    ``Fix(...)`` and ``Finding(...)`` it makes, and every verdict ``variant`` it sets (``{"variant": ...}``,
    ``variant=...``)."""
    out: dict[str, set[str]] = {"Fix": set(), "Finding": set(), "variant": set()}
    tree = ast.parse(Path(module.__file__).read_text())
    # a fix's own facts may have a variant too (the bf16 fix's): not a verdict's
    fix_facts = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id == "Fix" for a in n.args[1:]}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Fix", "Finding"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                out[node.func.id].add(node.args[0].value)
        if isinstance(node, ast.Call):
            out["variant"] |= {k.value.value for k in node.keywords
                               if k.arg == "variant" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)}
        if isinstance(node, ast.Dict) and id(node) not in fix_facts:
            out["variant"] |= {v.value for k, v in zip(node.keys, node.values, strict=True)
                               if isinstance(k, ast.Constant) and k.value == "variant"
                               and isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return out


def test_every_code_the_rules_write_has_words() -> None:
    written: dict[str, set[str]] = {"Fix": set(), "Finding": set(), "variant": set()}
    groups = sorted(Path(rules.__file__).parent.glob("rules_*.py"))  # every rules module by group, a new one too
    assert {p.stem for p in groups} >= {"rules_fp32", "rules_target", "rules_silent"}
    for module in (rules, context, refine, *(importlib.import_module(f"ampdoctor.judge.{p.stem}") for p in groups)):
        for kind, codes in _codes_written(module).items():
            written[kind] |= codes
    assert written["Fix"] and written["Fix"] <= set(fixes_words.FIXES), written["Fix"] - set(fixes_words.FIXES)
    variants = written["variant"]
    assert {"healthy", "frozen", "fp32_bug"} <= variants
    assert variants <= set(verdicts_words.SUMMARIES), variants - set(verdicts_words.SUMMARIES)
    assert set(verdicts_words.SUMMARIES) - {"healthy", "no_target"} <= set(verdicts_words.RULE_TITLES)
    codes = written["Finding"] - set(CAUSES) - {"data"}
    assert codes <= set(findings_words.FINDINGS), codes - set(findings_words.FINDINGS)
    for kind in ("nonfinite", "sentinel", "outlier", "beyond_fp16"):
        assert f"data_{kind}" in findings_words.FINDINGS


def test_data_scan_findings_are_worded_from_their_evidence() -> None:
    items = [(torch.ones(4, 3), torch.zeros(4)) for _ in range(N)]
    items[3][0][:, 0] = -99999.0
    items[6][0][0, 0] = NAN
    c = ctx(three(), data=Batches(items, cycled=False))
    d = diagnose(c.results, c.batches, c.cfg, c.recheck)
    _, findings, _, _ = diagnosis_words.write(d)
    by = {f.code: f for f in findings}
    assert by["data_nonfinite"].title == "batch 6 holds 1 NaN/Inf value(s) in inputs (samples [0])"
    assert by["data_nonfinite"].step == 6
    assert "-99999" in by["data_sentinel"].title and by["data_sentinel"].fix.startswith("Drop or fix these rows")


def test_a_replay_numbers_every_step_as_the_run() -> None:
    """Shift the data, then write the words: the summary, titles and fixes say the run's step."""
    rule, c, _, _ = _grad_overflow()
    c.results["bf16"] = with_record(stage("bf16", FALLING), 3, loss=NAN)
    d = diagnose(c.results, c.batches, c.cfg, c.recheck)
    assert d.outcome.step == 4
    s = shift_diagnosis(d, 1000)
    assert (s.outcome.step, s.outcome.facts["step"], s.outcome.findings[0].step) == (1004, 1004, 1004)
    assert d.outcome.step == 4, "a copy: the diagnosis itself is unchanged"
    verdict, findings, fixes, _ = diagnosis_words.write(s)
    assert "at step 1004" in verdict.summary and "step 4 " not in verdict.summary
    assert "(step 1003)" in fixes[-1]  # the bf16 stage's own failing step, as a fix fact


def test_counts_are_not_steps() -> None:
    """Facts that count steps (``steps_before``, ``steps``) are not shifted; ``*_step`` facts are, and so is
    ``batch``: a replay feeds one batch a step, so its batch k is the batch of the run's step offset + k."""
    out = Outcome("model_bug", None, 6, "fp32", {"variant": "fp32_diverged", "step": 6, "steps_before": 6,
                                                 "first_step": 2, "batch": 6, "max_grad_l2": 3.0})
    d = shift_diagnosis(rules.Diagnosis(out, [], None), 10)
    assert d.outcome.facts == {"variant": "fp32_diverged", "step": 16, "steps_before": 6, "first_step": 12, "batch": 16,
                               "max_grad_l2": 3.0}
    assert verdicts_words.summary(d.outcome.facts) == ("FP32 fails at step 16 on finite data: batch 16 is finite and trains from the "
                                              "initial weights, so the weights diverged over 6 steps (largest gradient "
                                              "norm before: 3).")


def test_not_reproduced_is_replay_relative_until_shifted() -> None:
    manifest = {"step": 1234, "reason": "nonfinite_loss", "module": "logits"}
    d = rules.not_reproduced(manifest, 0, 2, [{"loss": 0.5}, {"loss": None}], "amp", 1230, "cpu")
    assert d is not None and (d.outcome.cause, d.outcome.module, d.outcome.step) == ("not_reproduced", "logits", 4)
    verdict, findings, fixes, _ = diagnosis_words.write(shift_diagnosis(d, 1230))
    assert verdict.first_step == 1234 and verdict.summary.startswith("The run failed at step 1234 (nonfinite_loss)")
    assert "(loss 0.5, no step)" in verdict.summary
    assert findings[0].title == "the amp replay of step 1234 from the captured state finished cleanly 2 of 2 times"
    assert rules.not_reproduced(manifest, 1, 2, [], "amp", 1230, "cpu") is None


def test_a_finding_without_prose_until_written() -> None:
    f = Finding("thin_headroom", "warning", stage="amp", module="enc", evidence={"absmax": 60000.0, "headroom_binades": 0.127})
    title, fix = findings_words.FINDINGS[f.code](f, None)
    assert title == "enc reaches 6e+04, 0.13 binades below FP16's max"
    assert fix == "Fine now; if it keeps growing, keep enc in FP32 or use bf16."


def test_every_rule_has_a_scenario() -> None:
    assert set(rules.RULES) <= {make()[0] for make in SCENARIOS.values()}


def test_a_batch_beyond_range_is_not_the_data_when_it_never_reaches_a_module_or_the_model_makes_such_values() -> None:
    _, c, _, _ = _beyond_range_batch()
    c.fp32.stats[3].act[0] = row()  # masked before any module (the model's own code): the data scan's warning only
    assert rules_target.beyond_range_batch(c) is None
    _, c, _, _ = _beyond_range_batch()
    c.fp32.stats[1].act[1] = row(overflow=1, absmax=7e4)  # a module reads such values on an in-range batch too
    assert rules_target.beyond_range_batch(c) is None


def test_fp32_exploded_needs_the_captured_reason_and_fp32s_own_explosion_in_time() -> None:
    _, c, *_ = _fp32_exploded()
    for captured in (None, ("nonfinite_grad", 9), ("exploding_update", 7)):  # no capture, another reason, before FP32's
        c.captured = captured
        assert rules_fp32.fp32_exploded(c) is None, captured
    c.captured = ("exploding_update", 8)  # at the captured step itself
    assert rules_fp32.fp32_exploded(c) is not None
    c.fp32.records[8] = rec(8, 50.0, grad=999.0)  # FP32 does not explode (999x): not this rule, whatever the target did
    assert rules_fp32.fp32_exploded(c) is None
