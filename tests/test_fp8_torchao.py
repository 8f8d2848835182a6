"""ampdoctor's FP8 definitions against torchao's own casts, and the per-GEMM observer on a converted model.

Needs torchao (``pip install ampdoctor[fp8]``): skipped without it.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ampdoctor.formats import FP8_E4M3, FP8_E5M2
from ampdoctor.scaled import MXFP8, NVFP4, as_dict, block_quantize, fp8_cast, fp8_scale, operand_stats
from ampdoctor.watch.fp8 import GemmObserver, recipe_of

torchao = pytest.importorskip("torchao")
pytestmark = pytest.mark.fp8

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale  # noqa: E402


def _tensor(seed: int, rows: int, cols: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-int(spread), int(spread) + 1, (rows, cols), generator=g).float())
    x[torch.rand(rows, cols, generator=g) < 0.1] = 0
    return x


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 6), cols=st.integers(1, 40), spread=st.integers(0, 30),
       e5m2=st.booleans(), rowwise=st.booleans())
def test_scale_and_cast_are_torchaos(seed: int, rows: int, cols: int, spread: int, e5m2: bool, rowwise: bool) -> None:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    x = _tensor(seed, rows, cols, spread)
    fmt = FP8_E5M2 if e5m2 else FP8_E4M3
    gran = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
    theirs = hp_tensor_to_float8_dynamic(x, fmt.dtype, LinearMMConfig(), scaling_granularity=gran,
                                         axiswise_dim=-1 if rowwise else None, round_scales_to_power_of_2=rowwise)
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    ours = fp8_scale(amax, fmt, round_pow2=rowwise)
    assert torch.equal(ours, theirs._scale.reshape(ours.shape))
    assert torch.equal(fp8_cast(x, ours, fmt), theirs._data.float())
    if not rowwise:
        assert torch.equal(ours, tensor_to_scale(x, fmt.dtype))
    d = as_dict(operand_stats(x, fmt, rowwise=rowwise, round_pow2=rowwise))
    q = theirs._data.float()
    assert d["flushed"] == float(((x != 0) & (q == 0)).sum()) / x.numel()


def test_block_casts_are_torchaos() -> None:
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    for seed in range(20):
        x = _tensor(seed, 4, 64, 12)
        scale, data = to_mx(x.contiguous(), torch.float8_e4m3fn, 32)
        _, _, q = block_quantize(x, MXFP8)
        assert torch.equal(q.reshape(x.shape), data.float())
        pts = per_tensor_amax_to_scale(x.abs().amax())
        s8, packed = nvfp4_quantize(x.contiguous(), 16, pts)
        _, scaled, q4 = block_quantize(x, NVFP4)
        # the block scales: torchao's e4m3 block scale times the per-tensor scale is ampdoctor's divisor
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4

        vals = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(-1, 16)
        assert torch.equal(q4, vals)


def _converted(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return convert_to_float8_training(copy.deepcopy(m), config=cfg)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_observer_reads_each_gemm_operand(recipe: str) -> None:
    """Three operands per layer per step; the input's scale is the one torchao casts with; the run is unchanged."""
    model = _converted(recipe)
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16)
    obs = GemmObserver(model)
    with obs:
        obs.begin(0)
        model(x).sum().backward()
        rows = obs.end_step()
    twin(x).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    got = {(r.module, r.operand) for r in rows}
    assert got == {(m, o) for m in ("0", "2") for o in ("input", "weight", "grad_output")}
    inp = next(r for r in rows if r.module == "0" and r.operand == "input")
    want = fp8_scale(x.abs().amax(dim=-1, keepdim=True), FP8_E4M3, True).min() if recipe == "rowwise" else tensor_to_scale(x, torch.float8_e4m3fn)
    assert inp.stats["scale"] == float(want)
    go = next(r for r in rows if r.module == "2" and r.operand == "grad_output")
    assert go.fmt == ("fp8_e5m2" if recipe == "tensorwise" else "fp8_e4m3")
    assert recipe_of(model)["casts"]["grad_output"].endswith("rowwise" if recipe == "rowwise" else "tensorwise")
