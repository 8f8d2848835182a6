"""Compile as a rung (issue 44 item 1): the compiled stage, the bisection over the backends, the first op of the
graph, and the ``compile_numerics`` verdict only where eager PyTorch stays finite.

The fast tests check the parts (the rung, the comparison, the verdict and its words) without Inductor; the slow ones
run ``triage --compile`` end to end with Inductor's C++ backend on the CPU (a compile takes tens of seconds here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.engine.compiled import GraphOp, _clean_module, _differs
from ampdoctor.errors import UsageError
from ampdoctor.input.config import TriageConfig
from ampdoctor.judge.compiled import compile_outcome
from ampdoctor.ladder import AMP, FP16_PURE, rung
from ampdoctor.ladder.compile import CompileTransform, compiled
from ampdoctor.records import Finding, Outcome
from ampdoctor.report.words import findings as findings_words
from ampdoctor.report.words import fixes as fixes_words
from ampdoctor.report.words import verdicts as verdicts_words

ROOT = Path(__file__).resolve().parents[1]


def test_the_compile_rung_is_the_targets_precision_compiled() -> None:
    r = rung("compile", TriageConfig())
    assert (r.name, r.compute, r.params, r.scaler) == ("compile", AMP.compute, AMP.params, AMP.scaler)
    assert isinstance(r.transform, CompileTransform) and r.transform.name == "compile:inductor"
    pure = rung("compile", TriageConfig(target="fp16"))
    assert (pure.params, pure.master) == (FP16_PURE.params, FP16_PURE.master)
    emu = compiled(AMP, "inductor", emulate_precision_casts=True).transform
    assert emu.name == "compile:inductor+emulate_precision_casts"
    assert emu.describe() == {"name": emu.name, "backend": "inductor", "emulate_precision_casts": True}


def test_the_compiled_copy_keeps_the_users_names_and_leaves_the_model_alone() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    net = compiled(AMP, "eager").cast_model(model, torch.device("cpu"))
    assert net is not model and [n for n, _ in net.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p is not q for p, q in zip(net.parameters(), model.parameters(), strict=True))
    assert model._compiled_call_impl is None and net._compiled_call_impl is not None


def test_compile_is_asked_for_and_runs_last() -> None:
    assert TriageConfig(compile=True).stage_list() == ("fp32", "fp16", "amp", "compile")
    assert "compile" not in TriageConfig().stage_list()
    with pytest.raises(UsageError, match="--compile must be true or false"):
        TriageConfig(compile="yes")  # type: ignore[arg-type]


def test_differs_beyond_the_formats_rounding() -> None:
    a = torch.tensor([1.0, 2.0, 65504.0], dtype=torch.float16)
    assert not _differs(a, a.clone())
    assert not _differs(a, a + torch.tensor([0.0, 2 ** -9, 0.0]).half())  # one unit in the last place of 2.0
    assert _differs(a, torch.tensor([1.0, 2.5, 65504.0], dtype=torch.float16))
    assert _differs(a, torch.tensor([1.0, 2.0, math.inf], dtype=torch.float16))  # inf where eager is finite
    assert _differs(a, a[:2])  # another shape
    assert not _differs(torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))  # not a floating value


def test_module_names_from_dynamos_paths() -> None:
    assert _clean_module("blocks[0].attn") == "blocks.0.attn"
    assert _clean_module("self.mlp.up") == "mlp.up"
    assert _clean_module("") is None


def _facts(eager_ok: bool = True, stage: str | None = "inductor_codegen", emulate: bool | None = True) -> dict:
    op = GraphOp("nan_to_num", "nan_to_num", "mlp", "compile_nan.py:25", "h = torch.nan_to_num(h)",
                 65504.0, 60000.0, 0, 7)
    runs = [{"backend": "none", "emulate_precision_casts": False, "ok": eager_ok},
            {"backend": "eager", "emulate_precision_casts": False, "ok": True},
            {"backend": "aot_eager", "emulate_precision_casts": False, "ok": True},
            {"backend": "inductor", "emulate_precision_casts": False, "ok": False},
            {"backend": "inductor", "emulate_precision_casts": True, "ok": bool(emulate)}]
    return {"step": 0, "stage": stage if eager_ok else None, "backend": "inductor" if stage else None,
            "emulate_fixes": emulate, "eager_fails": not eager_ok, "runs": runs, "op": op.as_dict()}


def _healthy() -> Outcome:
    return Outcome("healthy", None, None, "amp", {"variant": "healthy", "stage": "amp", "ratio": None, "window": None,
                                                   "calibration_skips": 0})


def test_a_compile_only_failure_is_compile_numerics_with_the_stage_op_and_fixes() -> None:
    out = compile_outcome(_healthy(), _facts(), "amp")
    assert (out.cause, out.module, out.step, out.stage) == ("compile_numerics", "mlp", 0, "compile")
    assert [f.code for f in out.fixes] == ["compile_emulate_casts", "compile_disable", "compile_backend"]
    assert out.fixes[2].facts == {"backend": "aot_eager"}
    assert out.findings[0].code == "compile_numerics" and out.findings[0].evidence["op"] == "nan_to_num"
    s = verdicts_words.SUMMARIES["compile_numerics"](out.facts)
    assert "Inductor's generated code" in s and "nan_to_num (compile_nan.py:25, in mlp)" in s and "backend inductor fails, aot_eager stays finite" in s
    assert "emulate_precision_casts" in s
    texts = [fixes_words.fix_text(f) for f in out.fixes]
    assert "@torch.compiler.disable" in texts[1] and "mlp's forward" in texts[1] and "{" not in "".join(texts)


def test_no_emulation_fix_where_emulating_does_not_help() -> None:
    out = compile_outcome(_healthy(), _facts(emulate=False), "amp")
    assert [f.code for f in out.fixes] == ["compile_disable", "compile_backend"]
    assert "still fails" in verdicts_words.SUMMARIES["compile_numerics"](out.facts)


def test_a_model_that_fails_in_eager_too_is_not_a_compile_problem() -> None:
    eager_bad = compile_outcome(_healthy(), _facts(eager_ok=False), "amp")
    assert eager_bad.cause == "healthy" and eager_bad.findings[-1].code == "compile_eager_fails"
    bug = Outcome("model_bug", "log_features", 0, "fp32", {"variant": "fp32_bug"},
                  [Finding("model_bug", "error", stage="fp32", module="log_features", step=0)])
    kept = compile_outcome(bug, _facts(), "amp")
    assert (kept.cause, kept.module) == ("model_bug", "log_features") and kept.findings[-1].code == "compile_eager_fails"
    title, fix = findings_words.FINDINGS["compile_eager_fails"](kept.findings[-1], None)
    assert "not a compile problem" in title and fix
    assert compile_outcome(bug, None, "amp") is bug


# end to end, with Inductor's C++ backend on the CPU -------------------------------------------------------------

SAMPLES = ROOT / "sample_models"


@pytest.fixture
def one_compile_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor compiles in this process (no pool of workers to start on a small machine)."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.mark.slow
@pytest.mark.usefixtures("one_compile_thread")
def test_nan_only_under_inductor_is_compile_numerics_at_the_guard() -> None:
    """sample_models/compile_nan.py: eager AMP is healthy; Inductor fuses the FP16 product and its nan_to_num guard
    into one FP32 kernel, the guard passes ~1e5, the FP16 store makes it inf, the next matmul NaN."""
    from ampdoctor.engine.triage import triage

    report, run = triage(SAMPLES / "compile_nan.py", TriageConfig(steps=3, compile=True, device="cpu"))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("compile_numerics", "mlp", 0, "compile"), v.summary
    facts = run.compiled
    assert facts is not None and not facts["eager_fails"]
    assert [(r["backend"], r["ok"]) for r in facts["runs"]] == [
        ("none", True), ("eager", True), ("aot_eager", True), ("inductor", False), ("inductor", True)]
    assert facts["stage"] == "inductor_codegen" and facts["emulate_fixes"] is True
    op = facts["op"]
    assert op["op"] == "nan_to_num" and op["module"] == "mlp" and op["line"].startswith("compile_nan.py:")
    assert op["eager_nonfinite"] == 0 and op["compiled_nonfinite"] > 0
    assert "nan_to_num" in v.summary and "Inductor's generated code" in v.summary
    assert report.fixes[0].startswith("Set torch._inductor.config.emulate_precision_casts = True")
    assert {s.name for s in report.stages} == {"fp32", "fp16", "amp", "compile"}
    assert report.config["compile"] is True


@pytest.mark.slow
@pytest.mark.usefixtures("one_compile_thread")
def test_a_model_that_fails_in_eager_too_keeps_its_verdict_under_compile() -> None:
    """sample_models/model_bug.py (log of a ReLU: -inf in FP32 too) compiled: still model_bug, and the compile
    finding says it is not a compile problem."""
    from ampdoctor.engine.triage import triage

    report, run = triage(SAMPLES / "model_bug.py", TriageConfig(steps=2, compile=True, device="cpu"))
    assert (report.verdict.cause, report.verdict.first_module) == ("model_bug", "log_features")
    assert run.compiled is not None and run.compiled["eager_fails"] and run.compiled["stage"] is None
    assert [r["backend"] for r in run.compiled["runs"]] == ["none"]  # eager failed: no backend was tried
    assert report.findings[-1].code == "compile_eager_fails" and "not a compile problem" in report.findings[-1].title


@pytest.mark.slow
@pytest.mark.usefixtures("one_compile_thread")
def test_a_conv_nets_isinf_guard_under_pure_fp16_is_compile_numerics_too() -> None:
    """tests/compiled/conv_energy.py, unlike the sample: convolutions, a torch.where(isinf) guard, pure FP16 (the fp16
    target, SGD), a cross-entropy head."""
    from ampdoctor.engine.triage import triage

    report, run = triage(ROOT / "tests" / "compiled" / "conv_energy.py", TriageConfig(steps=2, target="fp16", compile=True,
                                                                                    device="cpu"))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("compile_numerics", "energy", 0, "compile"), v.summary
    facts = run.compiled
    assert facts is not None and facts["stage"] == "inductor_codegen" and facts["emulate_fixes"] is True
    assert facts["op"]["module"] == "energy" and facts["op"]["line"].startswith("conv_energy.py:")


def test_a_spec_that_returns_a_compiled_model_asks_for_the_compile_rung() -> None:
    from ampdoctor.engine.compiled import uncompiled

    net = nn.Linear(2, 2)
    seen: list[str] = []
    assert uncompiled(lambda: torch.compile(net), seen)() is net and seen == ["Linear"]
    plain: list[str] = []
    assert uncompiled(lambda: net, plain)() is net and plain == []


def test_the_capture_says_a_compiled_run_and_its_replay_runs_the_compile_rung() -> None:
    from ampdoctor.capture.state import model_identity
    from ampdoctor.ladder.compile import compiled_run, is_compiled

    net = nn.Sequential(nn.Linear(2, 2))
    assert not is_compiled(net) and "compiled" not in model_identity(net)
    assert is_compiled(torch.compile(net)) and model_identity(torch.compile(net))["compiled"] is True
    inplace = nn.Sequential(nn.Linear(2, 2))
    inplace.compile()
    assert is_compiled(inplace)

    class Wrapper(nn.Module):  # DDP-like: the compiled model is its .module
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.module = m

    assert is_compiled(Wrapper(torch.compile(net))) and not is_compiled(Wrapper(net))
    assert compiled_run({"model_identity": {"class": "x.Net", "compiled": True}})
    assert not compiled_run({"model_identity": {"class": "x.Net"}}) and not compiled_run({})


@pytest.mark.slow
@pytest.mark.usefixtures("one_compile_thread")
def test_a_monitored_compiled_run_is_captured_as_compiled_and_its_replay_bisects(tmp_path: Path) -> None:
    """The Monitor watches torch.compile(model) in a plain AMP loop; the NaN loss is captured, the manifest says the
    model was compiled, and triage --from runs the compile rung without --compile: compile_numerics at the guard."""
    import sys

    from ampdoctor import Monitor
    from ampdoctor.capture.read import read_capture
    from ampdoctor.engine.triage import triage

    sys.path.insert(0, str(SAMPLES))
    try:
        import compile_nan as sample  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(SAMPLES))
    torch.manual_seed(0)
    net = sample.build_model()
    model = torch.compile(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    cap = tmp_path / "cap"
    with Monitor(model, opt, torch.amp.GradScaler("cpu"), capture=str(cap), quiet=True) as mon:
        for x, y in sample.build_dataloader()[:2]:
            with mon.autocast():
                loss = sample.loss_fn(model(x), y)
            mon.step(loss, batch=(x, y))
    assert read_capture(cap).manifest["model_identity"]["compiled"] is True
    torch._dynamo.reset()
    report, run = triage(SAMPLES / "compile_nan.py", TriageConfig(device="cpu"), from_capture=cap)
    assert report.verdict.cause == "compile_numerics", report.verdict.summary
    assert run.config.compile and run.compiled is not None and run.compiled["op"]["op"] == "nan_to_num"
