"""``ampdoctor layers --dtype mxfp8,nvfp4``: each layer's block shares are exactly the direct emulation's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.layers_block import block_layer_stats
from ampdoctor.input.batches import materialise
from ampdoctor.scaled import MXFP8, NVFP4

from .conftest import SAMPLES
from .test_scaled import emulate_blocks


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 3))
    with torch.no_grad():
        m[0].weight[0] *= 1e5  # one row far above the rest: the blocks that hold it span more than the format
    return m


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 24, generator=g)
    x[0, :8] *= 1e-7
    return x, torch.randn(6, 3, generator=g)


@pytest.mark.parametrize("fmt", [MXFP8, NVFP4], ids=["mxfp8", "nvfp4"])
def test_step0_rows_are_the_emulations(fmt) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    x, y = _batch()
    df = block_layer_stats(model, materialise([(x, y)], 1), [fmt], steps=1,
                           loss_fn=lambda o, t: nn.functional.mse_loss(o, t))
    # the same step by hand: the outputs, the output gradients, the weights and their gradients
    outs: dict[str, torch.Tensor] = {}
    def keep(name: str):
        def hook(m: nn.Module, a: object, o: torch.Tensor) -> None:
            outs[name] = o
            o.retain_grad()
        return hook

    for name, mod in ref.named_children():
        mod.register_forward_hook(keep(name))
    nn.functional.mse_loss(ref(x), y).backward()
    want: dict[tuple[str, str, str], torch.Tensor] = {}
    for name, o in outs.items():
        want[(name, "act", "output")] = o.detach()
        want[(name, "act_grad", "output")] = o.grad
    for full, p in ref.named_parameters():
        mod, _, pn = full.rpartition(".")
        want[(mod, "param", pn)] = p.detach()
        want[(mod, "param_grad", pn)] = p.grad
    assert len(df) == len(want)
    assert df["exceeding_frac"].max() > 0, "the test model must put some blocks out of range"
    for r in df.itertuples(index=False):
        t = want[(r.module, r.kind, r.param)]
        rows = t.reshape(-1, t.shape[-1]).tolist() if t.dim() > 1 else [t.tolist()]
        e = emulate_blocks(rows, fmt.name)
        assert r.blocks == e["blocks"], (r, e)
        assert r.exceeding_frac == e["blocks_exceeding"] / e["blocks"], (r, e)
        assert r.flushed_frac == e["flushed"] / t.numel(), (r, e)
        assert r.saturated_frac == e["saturated"] / t.numel(), (r, e)


def test_layers_cli_block_formats_in_80_columns() -> None:
    res = CliRunner().invoke(app, ["layers", str(SAMPLES / "healthy.py"), "--dtype", "mxfp8,nvfp4", "--steps", "1"],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "mxfp8: blocks of 32" in res.output and "nvfp4: blocks of 16" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
