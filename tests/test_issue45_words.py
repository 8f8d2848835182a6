"""The Monitor's words about an event (issue 45 item 5): the first module of a non-finite batch is the first module
that reads the non-finite tensor, a label read only by the loss is "the batch's labels (the loss)"; ranks that go
non-finite at one step each on their own are said together, none "first"; a forecast names the module, not
``<model>``. The torchrun runs are slow (two processes); the rest run the exchange's own code on a real step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor import Monitor
from ampdoctor.judge.history import forecast
from ampdoctor.parallel.exchange import INPUT, RankExchange
from ampdoctor.records import LABELS, MODEL
from ampdoctor.report import alerts

ROOT = Path(__file__).resolve().parents[1]
FP16_MAX = 65504.0


class Reg(nn.Module):
    """A Hugging Face-style model: labels in, its loss computed in its own code (no module reads the labels)."""

    def __init__(self, prep: bool = False) -> None:
        super().__init__()
        self.prep = prep
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.prep:
            x = x * 2.0 - 1.0  # the model's own code reads the batch first; fc1 reads what it made
        out = self.fc2(torch.relu(self.fc1(x)))
        return {"loss": nn.functional.mse_loss(out.squeeze(-1), labels), "logits": out}


class Tower(nn.Module):
    """Unlike Reg: a conv stack reading a signal-like batch, its labels a target for a smooth-L1 loss in its code."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.relu(self.conv(x)).flatten(1))
        return {"loss": nn.functional.smooth_l1_loss(logits.logsumexp(1), labels), "logits": logits}


def _rank_fault(model: nn.Module, *args: torch.Tensor, derived: bool = False) -> tuple[int, str | None]:
    """What this rank's row of the exchange says of one real step (flags, module), decoded as every rank would."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = Monitor(model, opt, log=None, quiet=True)
    try:
        rec = mon.step(model(*args)["loss"])
    finally:
        mon.close()
    st = rec.stats
    assert st is not None
    keys = [("act", t) for t in st.act]
    rows = torch.as_tensor(np.stack([st.act[t] for t in st.act]))
    modules = [n or MODEL for n, _ in model.named_modules()]
    rx = RankExchange(None, 1, 2, modules, [n for n, _ in model.named_parameters()])
    rx.derived_inputs = derived
    row = rx.local_row(torch.device("cpu"), torch.tensor(True), torch.tensor(0), torch.tensor(0), st, keys, rows)
    host = np.zeros(10)
    host[5:] = row.numpy()
    f = rx.decode(host).first
    assert f is not None
    return f.flags, f.module


def test_a_nan_label_read_only_by_the_loss_is_the_batchs_labels_not_a_module() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 6), torch.randn(4)
    y[2] = float("nan")
    flags, module = _rank_fault(Reg(), x, y)
    assert flags & INPUT and module == LABELS
    torch.manual_seed(0)
    xi, yi = torch.randn(5, 3, 8), torch.tensor([0.0, 1.0, float("nan"), 2.0, 1.0])
    flags, module = _rank_fault(Tower(), xi, yi)
    assert flags & INPUT and module == LABELS


def test_a_nan_input_is_named_by_the_first_module_that_reads_it() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 6), torch.randn(4)
    x[1, 3] = float("nan")
    assert _rank_fault(Reg(), x, y)[1] == "fc1"
    assert _rank_fault(Reg(prep=True), x, y)[1] == "fc1"  # through the model's own code first
    xi, yi = torch.randn(5, 3, 8), torch.tensor([0.0, 1.0, 2.0, 2.0, 1.0])
    xi[0, 0, 0] = float("inf")
    assert _rank_fault(Tower(), xi, yi)[1] == "conv"


def test_a_finite_batch_through_broken_weights_is_no_input_under_fsdp_cast_inputs() -> None:
    """FSDP2 copies the batch before the first module (``derived_inputs``); after a NaN update was applied, a tensor
    the model's own code made (relu's output, read by fc2) is no copy of the batch: the fault is fc1's forward."""
    torch.manual_seed(0)
    model = Reg()
    with torch.no_grad():
        model.fc1.weight[3, 2] = float("nan")
    flags, module = _rank_fault(model, torch.randn(4, 6), torch.randn(4), derived=True)
    assert not flags & INPUT and module == "fc1"


def _failure(first: alerts.FirstRank) -> str:
    return alerts.failure_message(alerts.Failure(18, 32768.0, "nonfinite_loss", "", True, float("nan"), first=first))


def test_ranks_that_fail_together_are_said_together_and_a_label_in_words() -> None:
    both = alerts.FirstRank(0, "forward", "attn", False, False, ((0, "forward", "attn"), (1, "forward", "attn")))
    said = _failure(both)
    assert "went first" not in said and "ranks 0 and 1 went non-finite at this step each on its own, none first" in said
    assert "(0: forward in attn; 1: forward in attn)" in said
    one = alerts.FirstRank(1, "input", LABELS, True, False, ((1, "input", LABELS),))
    said = _failure(one)
    assert "rank 1 went first (input: the batch's labels (the loss)), the other ranks were clean" in said
    assert "<labels>" not in said


def test_the_forecast_names_the_module_not_the_model() -> None:
    """The model's output is block.fc2's: the two columns climb alike; the forecast names block.fc2."""
    t = np.arange(100, 164)
    a = (300.0 * t + 1000.0).reshape(-1, 1).astype(np.float32)
    cols = np.hstack([a, a, a * 0.001])
    fc = forecast(t, cols, np.zeros_like(cols), [MODEL, "block.fc2", "embed"], FP16_MAX, 200)
    assert [f.layer for f in fc] == ["block.fc2", MODEL]
    alone = forecast(t, a, np.zeros_like(a), [MODEL], FP16_MAX, 200)  # the model's own code alone: said as it is
    assert [f.layer for f in alone] == [MODEL]


DDP_BOTH = '''
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from ampdoctor import Monitor

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
with Monitor(model, opt, sc, log=None, capture=sys.argv[1]) as mon:
    for step in range(8):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        if step == 6:
            x[2] = 1.0e5  # finite in FP32, past FP16's range in layer 0's autocast: every rank's own forward overflows
        with mon.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        mon.step(loss, batch=(x, y))
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
'''


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_ddp_ranks_overflowing_in_their_own_forward_at_one_step_are_said_together(tmp_path: Path) -> None:
    script = tmp_path / "both.py"
    script.write_text(DDP_BOTH)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(tmp_path / "cap")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [ln for ln in r.stderr.splitlines() if "ampdoctor: step 6 failed" in ln]
    assert len(lines) == 1, r.stderr[-4000:]  # one message, from one rank
    assert "went first" not in lines[0] and "ranks 0 and 1 went non-finite at this step each on its own" in lines[0]
    assert "0: forward in 0" in lines[0] and "1: forward in 0" in lines[0]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_trainer_ddp_a_nan_label_on_one_rank_is_its_labels_not_a_module(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from ampdoctor.parallel.exchange import parse_column
    from ampdoctor.watch.steplog_read import read_step_log

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "assets" / "trainer_ddp_label.py"), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    firsts = set()
    for rank in (0, 1):
        f = read_step_log(out / f"steps.rank{rank}.csv").frame
        bad = f[f["ranks"].fillna("").astype(str) != ""]
        local = [t for t in parse_column(str(bad["ranks"].iloc[0])) if t[1] != "grad"]
        assert len(local) == 1 and local[0][1:] == ("input", LABELS), local  # no module read the labels
        firsts.add((int(bad["step"].iloc[0]), local[0][0]))
    assert len(firsts) == 1
    (step, rank), = firsts
    said = [ln for ln in r.stderr.splitlines() if ln.startswith(f"ampdoctor: step {step} failed")]
    assert len(said) == 1 and f"rank {rank} went first (input: the batch's labels (the loss))" in said[0], r.stderr[-3000:]


FSDP2_APPLIED = '''
import os, sys, torch, torch.distributed as dist
from pathlib import Path
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from ampdoctor import Monitor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2, self.head = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(self.act(self.fc1(x)))))  # tanh: the model's own code


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
model = Net()
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for sub in (model.fc1, model.fc2, model.head):
    fully_shard(sub, mp_policy=mp)
fully_shard(model, mp_policy=mp)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
out = Path(sys.argv[1])
g = torch.Generator().manual_seed(rank)
with Monitor(model, opt, None, log=out / "steps.csv", amp_dtype=torch.bfloat16, quiet=True) as mon:
    for step in range(7):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        if rank == 1 and step == 3:
            x[0, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        mon.after_backward(loss, batch=(x, y))
        opt.step()  # applied: the NaN update reaches every rank's weights
        mon.after_step()
        opt.zero_grad(set_to_none=True)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
'''


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_bf16_after_an_applied_nan_update_a_finite_batch_is_no_input(tmp_path: Path) -> None:
    from ampdoctor.parallel.exchange import parse_column
    from ampdoctor.watch.steplog_read import read_step_log

    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2_APPLIED)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    f = read_step_log(tmp_path / "steps.rank0.csv").frame.set_index("step")
    at3 = [t for t in parse_column(str(f.loc[3, "ranks"])) if t[1] != "grad"]
    assert at3 == [(1, "input", "fc1")], at3  # rank 1's own batch, read first by fc1
    for step in range(4, 7):  # every weight NaN now; both ranks' batches finite
        seen = parse_column(str(f.loc[step, "ranks"]))
        assert seen and all(kind != "input" for _, kind, _ in seen), (step, seen)


def test_a_monitor_forecast_of_a_growing_block_fc2_names_it_not_the_model() -> None:
    """late_growth's climb inside ``block.fc2``, the model returning it through its own code (``* 1.0``: the root's
    output, a tensor of the same values and trend): the forecast warning names block.fc2."""
    import warnings
    from collections import OrderedDict

    from ampdoctor.engine.ring import ForecastWarning

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(OrderedDict(fc1=nn.Linear(16, 64), act=nn.ReLU(), fc2=nn.Linear(64, 4)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(x) * 1.0

    torch.manual_seed(0)
    model = Root()
    model.block.fc1.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1.0)
    g = torch.Generator().manual_seed(2)
    data = [(16.0 * torch.randn(16, 16, generator=g), torch.ones(16, 4)) for _ in range(32)]
    with warnings.catch_warnings(record=True) as seen, Monitor(model, opt, torch.amp.GradScaler("cpu")) as mon:
        warnings.simplefilter("always")
        for step in range(200):
            x, y = data[step % len(data)]
            with mon.autocast():
                loss = (model(x).float() / 1e5 - y).pow(2).mean()
            mon.step(loss, batch=(x, y))
    fc = mon.lookback.warned if mon.lookback is not None else None
    assert fc is not None and fc.layer == "block.fc2", fc
    said = [str(w.message) for w in seen if issubclass(w.category, ForecastWarning)]
    assert len(said) == 1 and "block.fc2" in said[0] and MODEL not in said[0]
