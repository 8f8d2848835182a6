"""Issue 44 item 4: the forecast reads the ops inside modules, the activation and parameter gradients and the loss,
warns once per culprit with its name, before the failure, on runs that fail late by each kind of growth
(tests/growth_models.py), and says nothing on healthy runs (tests/ring_models.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor import Monitor
from ampdoctor.engine.growth import Growth
from ampdoctor.formats import FP16
from ampdoctor.records import NCOLS, Call, Col, StepStats
from ampdoctor.watch.opwatch import OpWatch

from .growth_models import GROWTH, TempAttention, run
from .ring_models import HEALTHY, train

ROOT = Path(__file__).resolve().parent.parent


def _row(absmax: float, inf: int = 0) -> np.ndarray:
    r = np.zeros(NCOLS)
    r[Col.NUMEL], r[Col.ABSMAX], r[Col.POSINF] = 4, absmax, inf
    return r


def _growth(reduced: set[str], loss_dtype: torch.dtype = torch.float32) -> Growth:
    ops = OpWatch(nn.Linear(1, 1), None, torch.float16)
    ops.reduced = set(reduced)
    g = Growth(FP16, torch.float16, ops, horizon=1000, quiet=True, speaks=False, device="cpu", params_reduced=set())
    g.loss_dtype = loss_dtype
    return g


def _stats(scale_grad: float, pgrad: float, op: float) -> StepStats:
    st = StepStats(0, calls=[Call("head", (0,), (1,)), Call("<model>", (0,), (1,)), Call("norm", (2,), (3,))])
    st.grad = {1: _row(scale_grad), 3: _row(5.0)}
    st.pgrad = {"head.weight": _row(pgrad), "norm.weight": _row(7.0)}
    st.extra = {"op:attn > matmul": op, "loss": 1.0}
    return st


def test_the_figures_of_a_step_are_unscaled_and_read_only_where_the_format_computes_them() -> None:
    g = _growth({"head"})
    figs = g.figures(_stats(2.0**16 * 3.0, 11.0, 123.0), loss=40.0, scale=2.0**16)
    # the gradient at head's output, recorded times the loss scale, unscaled; the model's own output (the same
    # tensor) is head's; norm returns FP32 (not in ``reduced``): neither its output's nor its weight's gradient
    assert figs == {"attn > matmul": ("op", 123.0), "head:grad": ("grad", 3.0), "head.weight:pgrad": ("pgrad", 11.0)}
    # an FP16 loss is a culprit too; an FP32 one cannot pass 65504
    g16 = _growth({"head"}, torch.float16)
    assert g16.figures(_stats(1.0, 1.0, 1.0), loss=-40.0, scale=None)["<loss>:loss"] == ("loss", 40.0)
    # a gradient that already holds an inf: no figure to fit (the series marks it non-finite)
    assert _growth({"head"}).figures(StepStats(0, calls=[Call("head", (), (1,))], grad={1: _row(1.0, inf=1)}),
                                     loss=1.0, scale=1.0)["head:grad"] == ("grad", math.inf)


def test_a_culprit_on_a_steady_climb_is_forecast_once_by_name() -> None:
    g = _growth({"head"})
    g.speaks, g.quiet = True, False
    with pytest.warns(UserWarning, match=r"step 30: the op attn > matmul \(inside the module") as seen:
        for s in range(0, 200, 1):  # every 2nd recorded step is read: 16 points by step 30
            g.push(s, _stats(1.0, 1.0, 1000.0 + 300.0 * s), loss=1.0, scale=1.0)
    assert len(seen) == 1 and list(g.warned) == ["attn > matmul"]
    assert g.warned["attn > matmul"].latest_step == 216  # 1000 + 300 t reaches 65504 at t = 215.01


def test_the_op_watch_reads_q_at_k_inside_the_module_in_the_users_forward() -> None:
    torch.manual_seed(0)
    attn = TempAttention(8)
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        want = (attn.q(x) @ attn.k(x).transpose(-2, -1)).abs().max().item()
    opt = torch.optim.SGD(attn.parameters(), lr=0.0)
    with Monitor(attn, opt, torch.amp.GradScaler("cpu"), quiet=True, watch_ops=True) as mon:
        with mon.autocast():
            loss = attn(x).float().pow(2).mean()
        rec = mon.step(loss)
    ops = {k: v for k, v in rec.stats.extra.items() if k.startswith("op:")}
    # the product; the weighted sum ``p @ v`` and the Linears' ops are their modules' outputs, the softmax is FP32
    assert set(ops) == {"op:<model> > matmul"}
    assert ops["op:<model> > matmul"] == want
    assert mon.lookback.growth.ops.reduced == {"q", "k", "v", "<model>"}


def test_no_forecast_while_every_step_is_skipped_after_a_failure() -> None:
    """A run that fails at step 20 and then skips every step (an Inf in a gradient each step: the weights stay
    as they were) while its batches grow: a trend in the activations, but no update applied. The forecast fits the
    applied steps only and says nothing while none is applied."""
    import warnings

    from ampdoctor.engine.ring import ForecastWarning
    from ampdoctor.judge.history import forecast

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Monitor(model, opt, torch.amp.GradScaler("cpu"), inject_inf_at=range(20, 140), alert_min_steps=10**9) as mon:
            for s in range(140):
                x = torch.randn(16, 8, generator=g) * (1.0 + 40.0 * max(0, s - 20))  # finite, growing, varying
                with mon.autocast():
                    loss = model(x).float().mean()
                mon.step(loss)
    assert mon.first_failure is not None and mon.first_failure[0] == 20
    assert [s for s, _ in mon.skips if s >= 20] == list(range(20, 140))  # every step since: no update
    assert [w for w in seen if issubclass(w.category, ForecastWarning)] == []
    assert mon.forecast() == [] and mon.lookback.growth.warned == {}
    # the same figures, skipped steps included, would have been called a trend
    ring = mon.lookback.ring
    steps, a = ring.layer_series("absmax")
    _, bad = ring.layer_series("nonfinite_frac")
    assert forecast(steps, a, bad, ring.names, 65504.0)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "culprit", "kind"), [
    ("attention_logits", "attn > matmul", "op"),
    ("head_seq_warmup", "head.weight:pgrad", "pgrad"),
    ("sum_loss_doubling", "2:grad", "grad"),
    ("fp16_sum_loss", "<loss>:loss", "loss"),
])
def test_each_growth_is_forecast_before_its_late_failure(name: str, culprit: str, kind: str) -> None:
    mon, said = run(GROWTH[name], 800, **({"watch_ops": True} if kind == "op" else {}))  # (ops: the opt-in)
    assert mon.first_failure is not None
    fail = mon.first_failure[0]
    assert fail >= 100  # late: after at least 100 clean steps
    warned = mon.lookback.growth.warned
    assert culprit in warned and warned[culprit].step < fail, (warned, fail)
    assert mon.lookback.warned is None  # no module's output was on course: the growth was out of its sight
    name_said = culprit.rsplit(":", 1)[0] if kind != "loss" else "the loss"
    assert any(name_said in s for s in said)
    assert len(said) == len(warned)  # once per culprit


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_no_growth_forecast_on_healthy_runs_of_1000_steps(name: str) -> None:
    mon, bad, said = train(HEALTHY[name], 1000, quiet=False, watch_ops=True)
    assert bad is None and said == []
    g = mon.lookback.growth
    assert g.warned == {} and len(g.steps) == 32 and g.series  # it read the ops and gradients all along (every 2nd)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_attention_logits_under_ddp_is_forecast_by_rank_0_once(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "growth_ddp.py"), "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    # one step for both ranks (the rank whose loss went NaN, and the other through the all-reduced gradients)
    assert r0["failure"] is not None and r1["failure"] is not None and r0["failure"][0] == r1["failure"][0] >= 100
    assert "attn > matmul" in r0["warned"] and r0["warned"]["attn > matmul"][0] < r0["failure"][0]
    assert r0["module_warned"] is None
    assert [s for s in r0["said"] if "attn > matmul" in s] and r1["said"] == []  # said once, by rank 0
