"""``parallel.deepspeed`` (ZeRO's layout, read with no DeepSpeed installed) on hand-made partitions where every number
is known: the attribute names are DeepSpeed's own (``_hp_mapping.hp_fragment_address`` / ``lp_fragment_address``,
``get_lp_grad_fragment``, ``bit16_groups``, ``single_partition_of_fp32_groups``), as 0.19 sets them; the runs
themselves are tests/test_integration_deepspeed.py's (``-m deepspeed``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ampdoctor.parallel import deepspeed as ds


def _param(shape: tuple[int, ...], hp: tuple[int, int] | None, lp: int = 0, grad: torch.Tensor | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape))
    if hp is not None:
        p._hp_mapping = SimpleNamespace(  # type: ignore[attr-defined]
            hp_fragment_address=SimpleNamespace(start=hp[0], numel=hp[1]),
            lp_fragment_address=SimpleNamespace(start=lp, numel=hp[1]),
            get_lp_grad_fragment=lambda i: grad)
        p._index_in_param_group = 0  # type: ignore[attr-defined]
    return p


def _engine(flat: torch.Tensor, params: list[nn.Parameter]) -> SimpleNamespace:
    inner = SimpleNamespace(state={flat: {"exp_avg": flat + 100, "step": torch.tensor(3.0)}},
                            param_groups=[{"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.0, "params": [flat],
                                           "bias_correction": True}])
    return SimpleNamespace(optimizer=SimpleNamespace(bit16_groups=[params], single_partition_of_fp32_groups=[flat],
                                                     optimizer=inner))


def test_a_ranks_pieces_sit_where_its_fragment_addresses_say_and_reassemble_whole() -> None:
    # a 2x3 weight flattened: rank 0 holds elements 0..1, rank 1 elements 2..5 (its partition starts with them at 1)
    whole = torch.arange(6, dtype=torch.float32)
    w0, b0 = _param((2, 3), (0, 2), lp=0), _param((2,), (2, 2), lp=0)
    w1, b1 = _param((2, 3), (1, 4), lp=2), _param((2,), None)
    flat0 = torch.cat([whole[:2], torch.tensor([10.0, 11.0])])
    flat1 = torch.cat([torch.tensor([-1.0]), whole[2:]])
    got = []
    for flat, (w, b) in ((flat0, (w0, b0)), (flat1, (w1, b1))):
        lay = ds.Layout(_engine(flat, [w, b]), {id(w): "w", id(b): "b"})
        model, where, state = lay.pieces()
        reader = ds.ENGINE.read(nn.Linear(3, 2), [], 0, 2)
        assert where["w"] == reader.piece(w) and reader.counts(w)
        assert lay.order == ["w", "b"]
        got.append((model, where, state))
    (m0, l0, s0), (m1, l1, s1) = got
    assert l0["w"] == {"shape": [2, 3], "flat": 0} and l1["w"] == {"shape": [2, 3], "flat": 2}
    assert m1["b"].numel() == 0 and l1["b"] == {"shape": [2], "flat": 0} and not ds.ENGINE.read(nn.Linear(1, 1), [], 1, 2).counts(b1)
    torch.testing.assert_close(ds.ENGINE.assemble([(m0["w"], l0["w"]), (m1["w"], l1["w"])], "w"), whole.reshape(2, 3))
    torch.testing.assert_close(s1[0]["exp_avg"], whole[2:] + 100)  # the optimizer state cut like the weight
    assert float(s1[0]["step"]) == 3.0 and s1[1]["exp_avg"].numel() == 0


def test_a_ranks_gradient_fragment_and_the_optimizer_a_replay_rebuilds() -> None:
    g = torch.arange(4, dtype=torch.float16)
    frag, start = ds.fragment(_param((2, 3), (1, 4), lp=2, grad=g))
    assert start == 2 and frag is not None and frag.dtype == torch.float32 and frag.tolist() == [0.0, 1.0, 2.0, 3.0]
    buf = torch.arange(6, dtype=torch.bfloat16)  # a whole-parameter buffer: only this rank's part counts
    frag, start = ds.fragment(_param((2, 3), (1, 4), lp=2, grad=buf))
    assert start == 2 and frag is not None and frag.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert ds.fragment(_param((2,), None)) == (None, 0)
    w = _param((2, 3), (0, 6))
    eng = _engine(torch.zeros(6), [w])
    opt = ds.layout_optimizer(eng, ds.Layout(eng, {id(w): "w"}))
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[0]["betas"] == (0.9, 0.99) and opt.param_groups[0]["params"][0] is w
