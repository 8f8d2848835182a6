"""``--autocast-policy cuda``: CUDA autocast's op policy emulated on the CPU (``ladder.policy``).

The reference is the installed torch's own CUDA autocast: the same model run on fake CUDA tensors
(``FakeTensorMode``: shapes and dtypes, no data, no GPU) under CUDA autocast gives each module's output
dtype; the emulation on real CPU tensors must give the same dtypes, where CPU autocast gives others."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

from ampdoctor import Monitor, TriageConfig, triage
from ampdoctor.cli.app import app
from ampdoctor.errors import UsageError
from ampdoctor.ladder.policy import cuda_policy, resolve

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_models" / "cuda_softmax.py"
sys.path.insert(0, str(ROOT / "sample_models"))
import cuda_softmax  # noqa: E402


class RMSNorm(nn.Module):
    """A hand-written RMSNorm: ``x.pow(2)`` overflows FP16 once |x| > 256 (CUDA runs pow in FP32)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class Block(nn.Module):
    """One pre-norm transformer block of many kinds of op: layer_norm, F.softmax attention, GELU MLP, RMSNorm,
    a hand-written log-sum-exp, a sum and a mean."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm = RMSNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        att = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        h = x + att @ v
        m = self.mlp(h)
        h = h + self.norm(m) + self.ln2(m)
        logits = self.head(h)
        return logits.exp().sum(-1).log().mean() + logits.mean()


def _dtypes(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.dtype)) for n, m in model.named_modules() if n]
    try:
        seen["(loss)"] = model(x).dtype
    finally:
        for h in hooks:
            h.remove()
    return seen


def _on_fake_cuda(dtype: torch.dtype) -> dict[str, Any]:
    """Each module's output dtype under the installed torch's real CUDA autocast, on fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = Block()
    with FakeTensorMode() as fake:
        for m in model.modules():  # no requires_grad: a CPU build has no CUDA device guard for autograd
            for name, p in list(m._parameters.items()):
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, device="cuda"), requires_grad=False)
        x = torch.empty(2, 5, 16, device="cuda")
        was = torch.is_autocast_enabled("cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        try:
            out = _dtypes(model, x)
        finally:
            torch.set_autocast_enabled("cuda", was)
            torch.clear_autocast_cache()
    del fake
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_module_gets_the_dtype_cuda_autocast_gives_it(dtype: torch.dtype) -> None:
    want = _on_fake_cuda(dtype)
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 5, 16)
    with cuda_policy(dtype) as log:
        got = _dtypes(model, x)
    with torch.autocast("cpu", dtype=dtype):
        cpu = _dtypes(model, x)
    assert got == want
    assert cpu != want  # CPU autocast's own policy differs
    assert want["ln"] == torch.float32 and want["qkv"] == dtype and want["mlp.1"] == dtype  # GELU: input's dtype
    assert want["norm"] == want["ln2"] == want["(loss)"] == torch.float32  # on the MLP's low-precision output
    assert cpu["ln2"] == cpu["(loss)"] == dtype
    assert {"layer_norm", "softmax", "pow", "exp"} <= set(log.facts()["fp32"])  # sum, log: on exp's FP32
    assert "mean" not in log.facts()["fp32"]  # not on CUDA's fp32 list: it runs in the input's dtype there too


def test_backward_runs_through_the_casts_and_the_rng_is_untouched() -> None:
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 5, 16)
    state = torch.get_rng_state()
    with cuda_policy(torch.float16):
        loss = model(x)
    assert torch.equal(torch.get_rng_state(), state)  # the probes ran on fake tensors under fork_rng
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name


def test_a_models_own_autocast_off_region_runs_as_written() -> None:
    x = torch.randn(4, 8)
    lin = nn.Linear(8, 8)
    with cuda_policy(torch.float16):
        assert lin(x).dtype == torch.float16
        for device in ("cpu", "cuda"):
            with torch.autocast(device, enabled=False):
                assert lin(x).dtype == torch.float32, device
        assert lin(x).dtype == torch.float16


def test_a_composite_it_cannot_cast_from_outside_is_said() -> None:
    mha, x = nn.MultiheadAttention(8, 2), torch.randn(3, 2, 8)
    with cuda_policy(torch.float16) as log:
        mha(x, x, x)
        F.scaled_dot_product_attention(x[None], x[None], x[None])
    f = log.facts()
    assert f["not_emulated"] == ["multi_head_attention_forward"]
    assert f["fused"] == ["scaled_dot_product_attention"]


def test_resolve() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve("auto", cpu, None) == ("native", "")
    assert resolve("cuda", cpu, None) == ("cuda", "asked")
    assert resolve("auto", cpu, {"device": "cuda:0"}) == ("cuda", "capture")
    assert resolve("native", cpu, {"device": "cuda:0"}) == ("native", "")
    assert resolve("cuda", cuda, None) == ("native", "")  # on a GPU CUDA autocast itself runs
    with pytest.raises(UsageError, match="--autocast-policy must be one of auto, native, cuda"):
        TriageConfig(autocast_policy="gpu")


SHORT = dict(steps=6, stages=("fp32", "amp"))


def test_the_sample_overflows_under_cpu_autocast_and_is_healthy_under_cudas() -> None:
    cpu, _ = triage(SAMPLE, TriageConfig(**SHORT))
    assert (cpu.verdict.cause, cpu.verdict.first_module, cpu.verdict.first_step) == ("fp16_forward_overflow", "attn", 0)
    assert "autocast_policy" not in cpu.config  # the default leaves the config (and every golden) as it was
    cuda, _ = triage(SAMPLE, TriageConfig(autocast_policy="cuda", **SHORT))
    assert cuda.verdict.cause == "healthy"
    assert cuda.config["autocast_policy"] == "cuda"
    note = next(n for n in cuda.notes if "CUDA's op policy" in n)
    assert "exp ran in FP32 on FP16 inputs" in note and "CPU autocast keeps it in FP16" in note
    assert not any(n.startswith("ran on the CPU: CPU autocast keeps") for n in cuda.notes)


POOL_SPEC = '''
import torch
from torch import nn


class MeanPool(nn.Module):
    """Masked mean pooling as sentence encoders write it: the mask in the embeddings' dtype, sum / count."""

    def forward(self, h, mask):
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)


class Encoder(nn.Module):
    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.pool = MeanPool()
        self.head = nn.Linear(d, 3)

    def forward(self, tokens):
        mask = tokens != 0  # token 0 pads
        h = torch.relu(self.proj(self.embed(tokens)))
        return self.head(self.pool(h, mask))


def build_model():
    torch.manual_seed(0)
    model = Encoder()
    with torch.no_grad():
        model.embed.weight.mul_(66.0)  # pretrained embeddings of large norm: token activations of ~100
    return model


def build_dataloader():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(4):
        tokens = torch.randint(0, 50, (4, 4096), generator=g)
        tokens[:, 3600:] = 0
        out.append((tokens, torch.randint(0, 3, (4,), generator=g)))
    return out


def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target)
'''


@pytest.mark.slow
def test_a_second_model_unlike_the_first_sum_in_a_pooling(tmp_path: Path) -> None:
    """A sentence encoder's masked mean pooling (sum / count, the mask in the activations' dtype): over 3,600
    tokens the sum passes 65504. CUDA runs sum in FP32; CPU autocast leaves it in FP16."""
    spec = tmp_path / "pool.py"
    spec.write_text(POOL_SPEC)
    cpu, _ = triage(spec, TriageConfig(steps=12, stages=("fp32", "amp")))
    assert (cpu.verdict.cause, cpu.verdict.first_module) == ("fp16_forward_overflow", "pool")
    cuda, _ = triage(spec, TriageConfig(autocast_policy="cuda", steps=12, stages=("fp32", "amp")))
    assert cuda.verdict.cause == "healthy"
    note = next(n for n in cuda.notes if "CUDA's op policy" in n)
    assert "sum ran in FP32 on FP16 inputs" in note


def _capture(folder: Path) -> int:
    """The sample's own AMP loop on the CPU until the Monitor captures (CPU autocast: step 0)."""
    model = cuda_softmax.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Monitor(model, opt, torch.amp.GradScaler("cpu"), capture=folder, activations=False) as mon:
        for step, (x, y) in enumerate(cuda_softmax.build_dataloader()):
            with mon.autocast():
                loss = cuda_softmax.loss_fn(model(x), y)
            if mon.step(loss, batch=(x, y)).capture:
                return step
    return -1


def test_a_capture_of_a_cuda_run_replays_under_cudas_policy_by_default(tmp_path: Path) -> None:
    folder = tmp_path / "cap"
    assert _capture(folder) == 0
    native, _ = triage(SAMPLE, TriageConfig(), from_capture=folder)
    assert native.verdict.cause == "fp16_forward_overflow"  # a CPU run's capture: CPU autocast, as it ran
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["device"] = "cuda:0"  # the same capture, as a GPU run writes it
    (folder / "manifest.json").write_text(json.dumps(manifest))
    report, _ = triage(SAMPLE, TriageConfig(), from_capture=folder)
    assert report.config["autocast_policy"] == "cuda" and report.config["autocast_policy_reason"] == "capture"
    note = next(n for n in report.notes if "CUDA's op policy" in n or "CUDA autocast's op policy" in n)
    assert note.startswith("the capture is of a CUDA run (cuda:0): its replay followed CUDA autocast's op policy")
    assert report.verdict.cause != "fp16_forward_overflow"  # under CUDA's policy exp is FP32: the forward is finite
    assert math.isfinite(report.stages[-1].final_loss or math.nan)
    again, _ = triage(SAMPLE, TriageConfig(autocast_policy="native"), from_capture=folder)
    assert again.verdict.cause == "fp16_forward_overflow"


def test_cli_option_and_its_bad_value(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["triage", str(SAMPLE), "--autocast-policy", "gpu", "--device", "cpu"])
    assert res.exit_code == 2
    assert "--autocast-policy must be one of auto, native, cuda (got 'gpu')" in res.output
    assert "Traceback" not in res.output
