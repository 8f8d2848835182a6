"""The five classes of misses at initialisation, each with a model of its own (tests/init_misses/), unlike the
project's samples, and each fixed by a rule derived from its definition (docs/diagnosis.md, "First module" and the
data scan)."""

from __future__ import annotations

from pathlib import Path

from ampdoctor import TriageConfig, triage

HERE = Path(__file__).parent / "init_misses"


def test_a_gradient_entering_through_the_roots_join_names_the_head_it_entered() -> None:
    report, run = triage(HERE / "joined_heads.py", TriageConfig(steps=2))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("fp16_grad_overflow", "mid", 0, "amp"), v.summary
    # the definition: mid's incoming gradient is non-finite, its siblings' are finite (they only share its input)
    from ampdoctor.records import nonfinite

    st = run.results["amp"].stats[0]
    bad_in = {c.module for c in st.calls if any(t in st.grad and nonfinite(st.grad[t]) > 0 for t in c.outputs)}
    assert "mid" in bad_in and not {"left", "right"} & bad_in


def test_underflow_over_several_layers_names_the_first_flushed_module_in_backward() -> None:
    report, run = triage(HERE / "reversed_tower.py", TriageConfig(steps=8, init_scale=1.0, growth_interval=100_000))
    v = report.verdict
    assert (v.cause, v.first_module) == ("fp16_grad_underflow", "out"), v.summary
    assert "The first module backward reaches with more than half of its parameter gradients flushed is out" in v.summary
    from ampdoctor.judge import locate

    order = locate.backward_order(run.results["amp"].stats[0])
    assert order.index("out") < order.index("blocks.0.0") < order.index("blocks.3.0")  # run in reverse of definition


def test_a_branch_frozen_behind_a_learnable_layerscale_under_weight_decay_is_not_healthy() -> None:
    report, run = triage(HERE / "layerscale_decay.py", TriageConfig(steps=16, target="fp16", stages=("fp32", "fp16")))
    v = report.verdict
    assert (v.cause, v.first_module, v.stage) == ("fp16_grad_underflow", "mixers.2.mlp.2", "fp16"), v.summary
    assert "only by weight decay" in v.summary
    fp16, fp32 = run.results["fp16"], run.results["fp32"]
    # why the movement rule alone missed it: decay moves the frozen weights as far as in FP32
    p = "mixers.2.mlp.2.weight"
    assert fp16.moved[p] / fp32.moved[p] > 0.9 and fp16.weight_decay[p] == 0.05
    assert fp16.records[-1].loss < 0.9 * fp16.records[0].loss  # the loss still falls


def test_a_loss_computed_in_the_roots_forward_never_names_the_model() -> None:
    report, _ = triage(HERE / "ctc_root.py", TriageConfig(steps=2))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step) == ("fp16_grad_overflow", None, 0), v.summary
    assert "<model>" not in v.summary and "the model's own parameter proj" in v.summary


def test_a_value_beyond_fp16_is_said_even_when_the_amp_run_is_healthy() -> None:
    report, _ = triage(HERE / "missing_sentinel.py", TriageConfig(steps=6))
    v = report.verdict
    assert v.cause == "healthy", v.summary
    assert "the data holds values FP16 cannot represent: inputs reaches 100000 (batch 3)" in v.summary
    data = [f for f in report.findings if f.code.startswith("data_")]
    assert data and "FP16 cannot represent it" in data[0].title
