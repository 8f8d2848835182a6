"""A sharded model's pieces without processes: the user's names, rows reduced by name, tensors reassembled.

The torchrun tests (tests/test_distributed.py) run the real engines; these check the arithmetic of
``parallel.pieces`` on hand-made pieces, where every number is known."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor.formats import FP16
from ampdoctor.parallel.pieces import Shards, assemble
from ampdoctor.records import NCOLS, Col, StepStats
from ampdoctor.watch.model_view import user_name
from ampdoctor.watch.stats import tensor_stats


def test_user_names_drop_the_engines_parts() -> None:
    assert user_name("_fsdp_wrapped_module.embed._fsdp_wrapped_module.weight") == "embed.weight"
    assert user_name("blocks.0._checkpoint_wrapped_module.attn.q.weight") == "blocks.0.attn.q.weight"
    assert user_name("_orig_mod.head.bias") == "head.bias"
    assert user_name("my_module.weight") == "my_module.weight"  # a user's own underscore stays


def test_pieces_reassemble_blocks_flat_slices_and_replicas() -> None:
    whole = torch.arange(24.0).reshape(6, 4)
    # a row-sharded DTensor's pieces, unevenly (3 + 3), and a column block
    rows = [(whole[:3], {"shape": [6, 4], "offset": [0, 0]}), (whole[3:], {"shape": [6, 4], "offset": [3, 0]})]
    assert torch.equal(assemble(rows, "w"), whole)
    cols = [(whole[:, :1], {"shape": [6, 4], "offset": [0, 0]}), (whole[:, 1:], {"shape": [6, 4], "offset": [0, 1]})]
    assert torch.equal(assemble(cols, "w"), whole)
    # FSDP1: slices of the flattened tensor, one of them empty
    flat = whole.reshape(-1)
    pieces = [(flat[:10], {"shape": [6, 4], "flat": 0}), (flat[10:10], {"shape": [6, 4], "flat": 10}),
              (flat[10:], {"shape": [6, 4], "flat": 10})]
    assert torch.equal(assemble(pieces, "w"), whole)
    # a replica on every rank: the whole tensor once
    assert torch.equal(assemble([(whole, {"shape": [6, 4], "offset": [0, 0]})] * 2, "w"), whole)
    with pytest.raises(ValueError, match="12 of 24 elements are in no rank's piece"):
        assemble(rows[:1] + [(whole[:3], {"shape": [6, 4], "offset": [0, 0]})], "w")


def test_rows_reduce_by_name_across_pieces_counted_once() -> None:
    """Two ranks' rows of one parameter's gradient, one rank with none for another parameter: the reduced row
    is the row of the whole tensor (counts summed, absmax the max, smallest non-zero the min)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    params = list(model.parameters())
    sh = Shards("fsdp1", model, params, rank=0, world=1)
    g = torch.tensor([[1e-9, 2.0, 0.0], [7e4, -3.0, 1.0], [0.5, 0.25, 1e-6], [4.0, 5.0, 6.0]])  # 0.weight's gradient
    b = torch.tensor([1.0, float("nan"), 2.0, 3.0])  # 0.bias's gradient, held by rank 1 alone
    names = [n for n, _ in sh.named]
    per_rank = [
        (["0.weight"], [g.reshape(-1)[:5]]),
        (["0.weight", "0.bias"], [g.reshape(-1)[5:], b]),
    ]
    total_s = None
    total_m = None
    for held, tensors in per_rank:
        keys = [("pgrad", n) for n in held]
        rows = tensor_stats(tensors, FP16)
        s, m = sh.tables(keys, rows)
        total_s = s if total_s is None else total_s + s  # what the SUM all-reduce does
        total_m = m if total_m is None else torch.maximum(total_m, m)  # and the MAX
    assert total_s is not None and total_m is not None
    st = StepStats(0)
    sh.apply(st, total_s.numpy(), total_m.numpy())
    assert set(st.pgrad) == {"0.weight", "0.bias"}  # no row for a parameter no rank held
    np.testing.assert_array_equal(st.pgrad["0.weight"], tensor_stats([g], FP16)[0].numpy())
    np.testing.assert_array_equal(st.pgrad["0.bias"], tensor_stats([b], FP16)[0].numpy())
    assert st.pgrad["0.bias"][Col.NAN] == 1 and len(st.pgrad["0.weight"]) == NCOLS
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_a_replica_counts_once_in_the_norm() -> None:
    """Under FSDP1's NO_SHARD (or a tensor-parallel model's plain parameters) every rank holds the whole tensor:
    only rank 0 adds its squares."""
    model = nn.Linear(2, 1)
    params = list(model.parameters())
    per = torch.tensor([3.0, 4.0])
    for rank, want in ((0, [9.0, 16.0]), (1, [0.0, 0.0])):
        sh = Shards("tensor_parallel", model, params, rank=rank, world=2)
        assert sh.sums(per, [0, 1], torch.device("cpu")).tolist() == want
    sh = Shards("fsdp1", model, params, rank=1, world=2)  # FULL_SHARD-like: every rank's slice counts
    assert sh.sums(per, [0, 1], torch.device("cpu")).tolist() == [9.0, 16.0]
    assert sh.sums(per[1:], [1], torch.device("cpu")).tolist() == [0.0, 16.0]  # a parameter without a gradient here


def test_a_3d_mesh_and_fsdp1_flat_parameters_turn_the_monitor_off_with_one_warning_and_hsdp_is_read() -> None:
    """HSDP x tensor parallelism (a 3-D mesh) and FSDP1 with use_orig_params=False: one MonitorOffWarning each, no
    raise, the loop trains on; HSDP (a 2-D mesh, ``parallel.hsdp``) is read: no warning, the monitor stays on (one
    process over gloo: every layout here is the same as on N ranks; 4 ranks: tests/test_mesh.py)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "tests" / "assets" / "unsupported_worker.py"), "hsdp", "hsdp_tp",
                        "fsdp1_flat"], capture_output=True, text=True, timeout=240, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {x["setup"]: x for x in map(json.loads, r.stdout.splitlines())}
    for setup, why in (("hsdp_tp", "3-D device mesh (1, 1, 1)"), ("fsdp1_flat", "use_orig_params=False")):
        x = got[setup]
        assert x["steps"] == 3 and x["off"] is not None and why in x["off"]
        assert [c for c, _ in x["said"]] == ["MonitorOffWarning"] and why in x["said"][0][1]
    assert got["hsdp"]["steps"] == 3 and got["hsdp"]["off"] is None and got["hsdp"]["said"] == []


class _TripHooks:
    """The monitor's hooks as ``trip_stats`` drives them: ``fail`` raises in after_backward (a rank-local failure
    before the rows are reduced); else end_step hands its rows to the exchange."""

    def __init__(self, rows: dict[str, torch.Tensor], fail: bool = False) -> None:
        self.rows, self.fail, self.exchanged = rows, fail, None

    def begin_step(self, step: int, record: bool = False) -> None:
        self.step = step

    def after_backward(self, inv: float | None) -> None:
        if self.fail:
            raise RuntimeError("statistics exploded on this rank")

    def after_step(self) -> None:
        pass

    def end_step(self, exchange=None):  # type: ignore[no-untyped-def]
        keys = [("pgrad", n) for n in self.rows]
        got = exchange(keys, tensor_stats(list(self.rows.values()), FP16))
        self.exchanged = got.numpy()
        return StepStats(self.step)


def test_a_sentinel_trip_whose_rows_fail_on_one_rank_still_joins_both_reductions(monkeypatch: pytest.MonkeyPatch) -> None:
    """No collective that only one rank joins: the failing rank joins the SUM and the MAX with the sizes the others
    use, its rows marked held by nobody, then raises; the rank that did not fail drops that step's rows."""
    import types

    import torch.distributed as dist

    from ampdoctor.parallel.pieces import trip_stats

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    sh = Shards("fsdp1", model, list(model.parameters()), rank=0, world=2)
    calls: list[tuple[int, object]] = []
    sent: dict[str, torch.Tensor] = {}

    def all_reduce(t: torch.Tensor, op: object = dist.ReduceOp.SUM, group: object = None) -> None:
        calls.append((t.numel(), op))
        key = "max" if op == dist.ReduceOp.MAX else "sum"
        if key in sent:  # the other rank's contribution
            t.copy_(torch.maximum(t, sent[key]) if key == "max" else t + sent[key])
        else:
            sent[key] = t.clone()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    ranks = types.SimpleNamespace(group=None)
    with pytest.raises(RuntimeError, match="exploded"):  # rank 1: fails before its rows, joins, then raises
        trip_stats(_TripHooks({}, fail=True), 7, None, sh, ranks)
    ns, nm = sh.sizes(True)
    want = [(ns - len(sh.counts), dist.ReduceOp.SUM), (nm, dist.ReduceOp.MAX)]
    assert calls == want
    st = trip_stats(_TripHooks({"0.weight": torch.ones(4, 3)}), 7, None, sh, ranks)  # rank 0: its rows are fine
    assert calls == want * 2  # the same two collectives, the same sizes
    assert st.pgrad == {} and st.extra["sentinel_trip"] == 1.0  # dropped, not one rank's rows taken as the whole
    sent.clear()
    st = trip_stats(_TripHooks({"0.weight": torch.ones(4, 3)}), 7, None, sh, types.SimpleNamespace(group=None))
    assert float(st.pgrad["0.weight"][Col.NUMEL]) == 12  # alone (nothing from another rank): its own rows
