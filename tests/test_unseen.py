"""Issue 39: three classes that failed on models unlike the project's samples, three test models each
(tests/unseen/), built before the rules changed. Each asserts the verdict, the module and the step that the
definitions in docs/diagnosis.md give, and the numbers behind them."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from ampdoctor import TriageConfig, triage
from ampdoctor.judge import locate
from ampdoctor.records import Col, nonfinite, stats_at

HERE = Path(__file__).parent / "unseen"


def _run(name: str, steps: int):  # type: ignore[no-untyped-def]
    opts = dict(runpy.run_path(str(HERE / name)).get("TRIAGE_OPTIONS", {}))
    if opts.get("target") == "fp16":
        opts["stages"] = ("fp32", "fp16")
    return triage(HERE / name, TriageConfig(steps=steps, **opts))


def _out_grad(st, module: str) -> tuple[bool, float]:  # type: ignore[no-untyped-def]
    """(non-finite?, largest finite |x|) of the gradient at a module's output in one step's statistics."""
    rows = [st.grad[t] for c in st.calls if c.module == module for t in c.outputs if t in st.grad]
    return any(nonfinite(r) > 0 for r in rows), max(float(r[Col.ABSMAX]) for r in rows)


# (a) a gradient overflow entering at a join of several heads ---------------------------------------------------------

JOINS = [  # spec, the head whose slice carries the inf, the other head
    ("join_logvar_mlp.py", "log_var", "mu"),  # root's cat, culprit listed last, both slices inf at 2^16
    ("join_heads_module.py", "heads.depth.2", "heads.seg"),  # a child's stack, culprit listed first
    ("join_token_laplace.py", "spread", "loc"),  # token model, root's cat, culprit listed first, both inf at 2^16
]


@pytest.mark.parametrize(("spec", "culprit", "other"), JOINS)
def test_a_join_names_the_head_whose_slice_carries_the_inf(spec: str, culprit: str, other: str) -> None:
    report, run = _run(spec, 2)
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("fp16_grad_overflow", culprit, 0, "amp"), v.summary
    amp, fp32, probe = (stats_at(run.results[k], 0) for k in ("amp", "fp32", "fp16"))
    assert _out_grad(amp, culprit)[0]  # the definition: its output gradient is non-finite at the failing step
    # in FP32 on the same step its part of the joined gradient is the larger one, and unscaled (raw FP16) only its
    # part overflows: it is the one that overflows first as the scale rises
    assert _out_grad(fp32, culprit)[1] > _out_grad(fp32, other)[1]
    assert _out_grad(probe, culprit)[0] and not _out_grad(probe, other)[0]


# (b) residual branches frozen by underflow behind a learnable LayerScale, pure FP16 ----------------------------------

SCALES = [  # spec, module, modules flushed at step 0
    ("layerscale_convnext.py", "stages.2.pw2", 12),  # every block, SGD, gamma 1e-6
    ("layerscale_cait.py", "blocks.3.mlp.2", 12),  # the two deep blocks only, attention + MLP branches
    ("layerscale_mixer_first.py", "blocks.0.channel.2", 6),  # the first block only, gamma 1e-7, Adam eps 1e-4
]


@pytest.mark.parametrize(("spec", "module", "flushed"), SCALES)
def test_a_branch_behind_a_tiny_layerscale_is_flushed_in_pure_fp16(spec: str, module: str, flushed: int) -> None:
    report, run = _run(spec, 8)  # (the branches thaw as the scales grow: the frozen-weights rule does not hold)
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("fp16_grad_underflow", module, 0, "fp16"), v.summary
    assert f"100% of {module}'s parameter gradients (non-zero in FP32 on the same step) flush to zero" in v.summary
    assert f"({flushed} module(s) in all at that step)" in v.summary
    fp16, fp32 = run.results["fp16"], run.results["fp32"]
    st, ref = stats_at(fp16, 0), stats_at(fp32, 0)
    own = locate.own_params(module, st.pgrad)
    assert own and all(locate.flushed_frac(st.pgrad[p], ref.pgrad[p]) == 1.0 for p in own)
    # every module backward reaches before it keeps its gradients (the head, the trunk above the fault)
    order = locate.backward_order(st)
    before = [m for m in order[: order.index(module)] if locate.own_params(m, st.pgrad)]
    assert before and all(locate.flushed_frac(st.pgrad[p], ref.pgrad[p]) < 0.5 for m in before
                          for p in locate.own_params(m, st.pgrad))
    # why the movement and stall rules missed it: the scale learns, the loss falls, nothing is non-finite
    assert fp16.records[-1].loss < fp16.records[0].loss


# (c) a batch value beyond FP16's range that AMP survives --------------------------------------------------------------

BEYOND = [  # spec, steps (one per batch: the typical magnitude is over them), batch, position, first module reading it
    ("sentinel_inputs_embeds.py", 6, 2, "inputs_embeds[5, 3, 7] = -999999, 1.47e+06x", "ln"),
    ("unit_error_groupnorm.py", 6, 4, "inputs[11, 2, 40] = 150000, 751x", "norm"),
    ("sentinel_batchnorm.py", 7, 1, "inputs[0, 3] = -1e+07, 6.63e+06x", "0"),
]


@pytest.mark.parametrize(("spec", "steps", "batch", "where", "reader"), BEYOND)
def test_a_batch_value_beyond_fp16_that_amp_survives_is_data(spec: str, steps: int, batch: int, where: str,
                                                             reader: str) -> None:
    report, run = _run(spec, steps)
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("data", None, batch, "amp"), v.summary
    assert f"Batch {batch} holds a value FP16 cannot represent: {where}" in v.summary
    assert f"The first module reading it is {reader};" in v.summary
    assert f"raw FP16 fails on it at step {batch}" in v.summary
    assert all(r.loss == r.loss for r in run.results["amp"].records)  # AMP survives it: no NaN loss
