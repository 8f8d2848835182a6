"""ampdoctor layers: real tiny models, real numbers, and the command line."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampdoctor import layer_stats
from ampdoctor.cli.app import app
from ampdoctor.engine.layers import COLUMNS, advise, choose_scale
from ampdoctor.formats import FP16
from ampdoctor.report.layers_doc import recommendation
from ampdoctor.report.words import layers as layer_words

from .conftest import write_spec

runner = CliRunner()
REQUIRED = ["module", "kind", "param", "dtype", "scale", "step", "numel", "absmax", "min_nonzero", "overflow_frac",
            "underflow_frac", "subnormal_frac", "nonfinite_frac", "headroom_binades"]


class Gain(nn.Module):
    def __init__(self, g: float) -> None:
        super().__init__()
        self.g = g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


class Net(nn.Module):
    """``big`` multiplies by 2e5, so its output exceeds FP16's 65504 for most elements."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.big = Gain(2e5)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.big(self.inp(x)) * 1e-5)


def batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def mse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(o, t)


def captured_step0(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Module outputs and every gradient of step 0, recorded by hand with plain torch."""
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    hs = []
    for name, m in model.named_modules():
        def hook(mod: nn.Module, a: object, o: torch.Tensor, name: str = name or "<model>") -> None:
            acts[name] = o.detach().clone()
            o.register_hook(lambda g, name=name: grads.__setitem__("at " + name, g.detach().clone()))
        hs.append(m.register_forward_hook(hook))
    x, t = batches()[0]
    mse(model(x), t).backward()
    for h in hs:
        h.remove()
    for n, p in model.named_parameters():
        assert p.grad is not None
        grads["of " + n] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return acts, grads


@pytest.fixture(scope="module")
def net_df() -> tuple[Net, pd.DataFrame]:
    torch.manual_seed(0)
    model = Net()
    df = layer_stats(model, batches(), dtypes="fp16,bf16,fp8_e4m3", steps=2, scale="auto", loss_fn=mse)
    return model, df


def test_overflowing_layer_is_seen_in_fp16_not_bf16(net_df: tuple[Net, pd.DataFrame]) -> None:
    model, df = net_df
    acts, _ = captured_step0(model)  # the model was restored after layer_stats: same step 0
    big = acts["big"]
    want = float(((big.abs() >= FP16.overflow_threshold)).float().mean())
    assert want > 0.1
    assert math.isinf(float(big.abs().max().half()))
    row = df[(df.module == "big") & (df.kind == "act") & (df.step == 0)].set_index("dtype")
    assert row.loc["fp16", "overflow_frac"] == want
    assert row.loc["fp16", "absmax"] == float(big.abs().max())
    assert row.loc["fp16", "headroom_binades"] == pytest.approx(math.log2(65504 / float(big.abs().max())))
    assert row.loc["bf16", "overflow_frac"] == 0
    assert row.loc["fp8_e4m3", "overflow_frac"] > want
    # the same exact check for the module before: nothing overflows
    assert df[(df.module == "inp") & (df.kind == "act")]["overflow_frac"].max() == 0
    assert set(df.kind) == {"act", "act_grad", "param", "param_grad"}
    assert list(df.columns) == COLUMNS


def test_auto_scale_and_the_limiting_layer(net_df: tuple[Net, pd.DataFrame]) -> None:
    model, df = net_df
    _, grads = captured_step0(model)
    step0 = df[df.step == 0]
    # the largest power of two that overflows no gradient of step 0, computed by hand
    worst_name, worst = max(((n, float(g.abs().max())) for n, g in grads.items()), key=lambda kv: kv[1])
    k = max(k for k in range(-40, 60) if worst * 2.0**k < FP16.overflow_threshold)
    g16 = step0[(step0.dtype == "fp16") & step0.kind.isin(["act_grad", "param_grad"]) & (step0.scale == 1.0)]
    assert g16["max_scale"].min() == 2.0**k
    choice = choose_scale(df, "fp16")
    assert choice.scale == min(2.0**k, choice.hi) and choice.scale == df[df.kind.isin(["act_grad", "param_grad"]) & (
        df.dtype == "fp16")]["max_scale"].min()
    assert choice.overflow_limit is not None
    # the gradient rows at the chosen scale: nothing overflows there, and twice the scale would
    at = df[(df.dtype == "fp16") & (df.scale == choice.scale) & df.kind.isin(["act_grad", "param_grad"])]
    assert len(at) > 0 and at["overflow_frac"].max() == 0
    if choice.overflow_limit.step == 0:
        assert worst_name.split(" ", 1)[1] in layer_words.tensor(choice.overflow_limit)
    # bf16 needs no scale; the advice says bf16 removes the fp16 activation overflow
    assert choose_scale(df, "bf16").scale == 1.0
    a = advise(df, "fp16")
    assert a.verdict == "unsafe" and "big" in a.keep_high and a.bf16_fixes is True
    assert advise(df, "bf16").verdict == "safe"


def test_model_and_optimizer_are_restored() -> None:
    torch.manual_seed(0)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.eval()
    layer_stats(model, batches(), steps=2, loss_fn=mse, optimizer=opt, what="weights")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training and opt.state_dict()["state"] == {}


def test_numeric_scale_and_what() -> None:
    torch.manual_seed(0)
    df = layer_stats(Net(), batches(), steps=1, scale=1024.0, what=("grads",), loss_fn=mse)
    assert set(df.kind) == {"act_grad", "param_grad"} and set(df.scale) == {1024.0}
    assert (df.max_scale > 0).all() and (df.min_scale >= 0).all()


# the command line ------------------------------------------------------------------------------

SPEC = (Path(__file__).parent / "assets" / "gain_spec.py").read_text()


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path, SPEC)


def invoke(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, ["layers", *args, "--device", "cpu"], env={"COLUMNS": "100"})
    return r.exit_code, r.output


def test_cli_table_advice_and_csv(spec: Path, tmp_path: Path) -> None:
    out_csv = tmp_path / "t.csv"
    code, text = invoke(str(spec), "--dtype", "fp16,bf16", "--steps", "2", "--scale", "auto", "--csv", str(out_csv))
    assert code == 0, text
    assert "fp16: not safe as is" in text and "bf16: safe for this model as is" in text
    assert "big: output overflow fp16" in text and "GradScaler(init_scale=" in text and "2**" not in text
    assert "bf16: removes the range problem" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    df = pd.read_csv(out_csv)
    assert set(REQUIRED) <= set(df.columns)
    assert set(df.dtype) == {"fp16", "bf16"} and set(df.step) == {0, 1}
    big = df[(df.module == "big") & (df.kind == "act")]
    assert (big[big.dtype == "fp16"].overflow_frac > 0).all() and (big[big.dtype == "bf16"].overflow_frac == 0).all()


def test_cli_filter_top_and_sort(spec: Path) -> None:
    code, text = invoke(str(spec), "--filter", "^big$", "--what", "activations", "--steps", "1", "--top", "1",
                        "--sort", "overflow_frac")
    assert code == 0, text
    assert any(line.split()[:1] == ["big"] for line in text.splitlines()) and "inp" not in text.split("fp16: ")[0]


@pytest.mark.parametrize(("args", "message"), [
    (["--dtype", "fp12"], "unknown format 'fp12'; supported: fp16, bf16, fp8_e4m3, fp8_e5m2"),
    (["--filter", "nomatch"], "--filter 'nomatch' matches no module"),
    (["--filter", "("], "not a valid regular expression"),
    (["--what", "logits"], "unknown --what 'logits'"),
    (["--scale", "-3"], "give a positive number"),
    (["--sort", "colour"], "--sort 'colour': choose one of"),
    (["--steps", "0"], "--steps must be at least 1"),
])
def test_cli_bad_input_is_one_line_exit_2(spec: Path, args: list[str], message: str) -> None:
    code, text = invoke(str(spec), *args)
    assert code == 2
    assert message in " ".join(text.split()) and "Traceback" not in text


def test_cli_existing_output_needs_force_and_is_checked_first(tmp_path: Path, spec: Path) -> None:
    target = tmp_path / "out.csv"
    target.write_text("keep me")
    broken = write_spec(tmp_path, "def build_model():\n    raise RuntimeError('boom')\n"
                                  "def build_dataloader():\n    return []\n", "broken.py")
    code, text = invoke(str(broken), "--csv", str(target))  # refused before the model is even built
    assert code == 2 and "exists" in text and "--force" in text and "boom" not in text
    assert target.read_text() == "keep me"
    code, text = invoke(str(spec), "--csv", str(target), "--force", "--steps", "1", "--what", "weights")
    assert code == 0, text
    assert "module,kind,param,dtype" in target.read_text()


def test_cli_parquet_without_pyarrow(spec: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    code, text = invoke(str(spec), "--parquet", str(tmp_path / "t.parquet"))
    assert code == 2 and "pip install pyarrow" in text
    assert not (tmp_path / "t.parquet").exists()


def test_cli_fp8_on_a_torch_without_it(spec: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn")
    code, text = invoke(str(spec), "--dtype", "fp16,fp8_e4m3")
    assert code == 2 and "has no float8_e4m3fn" in text and "upgrade torch" in text


class _ExpNorm(nn.Module):
    """A hand-written softmax without the max subtraction: exp(12 x) overflows FP16 inside the module (e^12 =
    1.6e5) while its output, normalised, stays within [0, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(12.0 * self.proj(x))
        return e / e.sum(-1, keepdim=True)  # noqa: AMP009 - the hand-written softmax is the point


def test_layers_names_the_module_whose_inner_op_overflows_and_says_it_measures_outputs_only() -> None:
    """What module hooks cannot see: an op inside a module. The q @ k^T of forward_overflow.py (triage's
    verdict: blocks.1.attn, its matmul at 7.571e+04) and, unlike it, an exp inside a module with no matmul."""
    spec = importlib.util.spec_from_file_location("fo_sample", Path(__file__).resolve().parent.parent / "sample_models"
                                                  / "forward_overflow.py")
    assert spec is not None and spec.loader is not None
    fo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fo)
    from ampdoctor.judge.ranges import advise

    torch.manual_seed(0)
    df = layer_stats(fo.build_model(), fo.build_dataloader(), ["fp16", "bf16"], steps=1, loss_fn=getattr(fo, "loss_fn", None))
    a = advise(df, "fp16")
    assert a.verdict == "unsafe" and [(o["module"], o["op"]) for o in a.inner] == [("blocks.1.attn", "matmul")]
    assert abs(a.inner[0]["absmax"] - 7.571e4) < 7.571e4 * 2**-10  # triage's figure, within FP16's precision
    rec = recommendation(df, "fp16")
    assert "inside the module (its output fits)" in {k["module"]: k["reason"] for k in rec["keep_high"]}["blocks.1.attn"]
    assert any("layers measures module outputs and parameters only" in n for n in rec["notes"])
    assert not advise(df, "bf16").inner and advise(df, "bf16").verdict == "safe"  # 7.6e4 is nothing to bf16

    model = nn.Sequential(nn.Linear(4, 4), _ExpNorm())
    with torch.no_grad():
        for lin in (model[0], model[1].proj):
            lin.weight.copy_(torch.eye(4))
            lin.bias.zero_()
    x = torch.ones(8, 4)  # exp(12 * 1) = 1.6e5 inside; the output 0.25 everywhere
    df2 = layer_stats(model, [(x, torch.zeros(8, 4))], ["fp16"], steps=1, loss_fn=nn.functional.mse_loss)
    out = df2[(df2["kind"] == "act") & (df2["module"] == "1")]
    assert not out.empty and (out["overflow_frac"] == 0).all()  # no module row shows it
    got = advise(df2, "fp16")
    assert [(o["module"], o["op"]) for o in got.inner] == [("1", "exp")] and got.verdict == "unsafe"
    assert got.inner[0]["overflow_frac"] == 1.0 and abs(got.inner[0]["absmax"] - math.exp(12)) < 1.0


def test_layers_words_say_each_code_with_its_figures() -> None:
    """The advice is facts (codes and figures, ``judge.ranges``); ``report.words.layers`` words each one."""
    from ampdoctor.judge.ranges import KeepReason, Note, TensorAt

    kr = layer_words.keep_reason
    assert kr(KeepReason("overflow", "fp16", "act")) == "output overflow fp16"
    assert kr(KeepReason("underflow", "fp8_e4m3", "param", 0.01)) == "weights underflow fp8_e4m3 (> 1%)"
    assert kr(KeepReason("no_scale", "fp16")) == "its gradients underflow at every scale that overflows nothing"
    assert kr(KeepReason("inner_op", "fp16", op="exp", absmax=162754.79, max=FP16.max)) == (
        "its exp op reaches 1.628e+05 in FP32, beyond fp16's max 65504, inside the module (its output fits)")
    g0, w = TensorAt("0", "act_grad", "output", 2), TensorAt("head", "param_grad", "weight", 0)
    assert layer_words.tensor(g0) == "gradient at module 0's output (step 2)"
    assert layer_words.tensor(w) == "gradient of head.weight (step 0)"
    gap = layer_words.note(Note("no_scale_fits", overflow=w, underflow=g0, hi=2.0**7, lo=2.0**10, tolerance=0.01))
    assert gap == ("no loss scale fits every gradient: gradient of head.weight (step 0) overflows above 2^7 while "
                   "gradient at module 0's output (step 2) loses more than 1% to underflow below 2^10")
    bad = layer_words.note(Note("fp32_nonfinite", at=TensorAt("blocks.1", "act", "output", 3)))
    assert bad.startswith("the FP32 reference already has NaN/Inf (output of blocks.1 (step 3))")
