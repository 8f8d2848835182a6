"""Bad input gets one line, exit 2, no traceback; odd-but-valid specs work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ampdoctor.cli.app import app
from ampdoctor.engine.triage import triage
from ampdoctor.input.config import TriageConfig

from .conftest import SAMPLES, write_spec

GOOD_DATA = """
import torch
def build_dataloader():
    return [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
"""
GOOD_MODEL = """
import torch
def build_model():
    return torch.nn.Linear(3, 1)
def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)
"""

BAD = {
    "missing_model": (GOOD_DATA, "has no function build_model()"),
    "syntax": (GOOD_MODEL + "\ndef broken(:\n", "syntax error"),
    "import": ("import not_a_module_xyz\n" + GOOD_MODEL + GOOD_DATA, "import failed"),
    "wrong_model_type": (GOOD_DATA + "\ndef build_model():\n    return 3\n", "returned int"),
    "empty_loader": (GOOD_MODEL + "\ndef build_dataloader():\n    return []\n", "yielded no batches"),
    "strings": (GOOD_MODEL + "\ndef build_dataloader():\n    return [('a cat', 'a dog')]\n", "holds no tensors"),
    "no_loss": (GOOD_DATA + "\nimport torch\ndef build_model():\n    return torch.nn.Linear(3, 1)\n", "reduce it"),
    "raises": (GOOD_DATA + "\ndef build_model():\n    raise ValueError('no weights here')\n", "build_model() raised ValueError"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_spec_one_line_exit_2(tmp_path: Path, case: str) -> None:
    body, expected = BAD[case]
    spec = write_spec(tmp_path, body)
    res = CliRunner().invoke(app, ["triage", str(spec), "--steps", "2"])
    assert res.exit_code == 2, res.output
    assert expected in res.output
    assert "Traceback" not in res.output
    assert res.output.strip().startswith("error:")


def test_missing_file_and_bad_options(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["triage", str(tmp_path / "nope.py")])
    assert r.exit_code == 2 and "no such file" in r.output
    spec = write_spec(tmp_path, GOOD_MODEL + GOOD_DATA)
    r = CliRunner().invoke(app, ["triage", str(spec), "--target", "fp4"])  # (fp8 is one: tests/test_fp8_triage.py)
    assert r.exit_code == 2 and "--target must be one of" in r.output
    r = CliRunner().invoke(app, ["triage", str(spec), "--steps", "0"])
    assert r.exit_code == 2 and "--steps" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_that_is_not_there(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, GOOD_MODEL + GOOD_DATA)
    r = CliRunner().invoke(app, ["triage", str(spec), "--device", "cuda"])
    assert r.exit_code == 2
    assert "no CUDA device" in r.output and "--device cpu" in r.output


def test_existing_json_is_not_overwritten(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, GOOD_MODEL + GOOD_DATA)
    out = tmp_path / "report.json"
    out.write_text("keep me")
    r = CliRunner().invoke(app, ["triage", str(spec), "--json", str(out), "--steps", "2"])
    assert r.exit_code == 2 and "--force" in r.output
    assert out.read_text() == "keep me"
    r = CliRunner().invoke(app, ["triage", str(spec), "--json", str(out), "--steps", "2", "--force"])
    assert r.exit_code in (0, 1) and out.read_text().startswith("{")


def test_dict_batches_and_model_computed_loss(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, """
import torch
from torch import nn

class Out:
    def __init__(self, loss): self.loss = loss

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)
    def forward(self, input_ids, labels, attention_mask=None):
        logits = self.head(self.emb(input_ids))
        return Out(nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten()))

def build_model():
    return LM()

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 11, (2, 5), generator=g), "labels": torch.randint(0, 11, (2, 5), generator=g),
             "attention_mask": torch.ones(2, 5), "note": "strings pass through"} for _ in range(4)]
""")
    report, run = triage(spec, TriageConfig(steps=10))
    results = run.results
    assert report.verdict.cause == "healthy", report.verdict.summary
    assert any("cycled" in n for n in report.notes)
    # integer inputs are never cast: the raw FP16 stage still ran the embedding
    assert results["fp16"].error is None and len(results["fp16"].records) == 10


def test_stage_error_is_recorded_and_other_stages_run() -> None:
    report, run = triage(SAMPLES / "lstm_cpu.py", TriageConfig(steps=4, device="cpu"))
    results = run.results
    amp = results["amp"]
    assert amp.error is not None and amp.error.module == "encoder"
    assert "oneDNN" in amp.error.hint and "not a NaN cause" in amp.error.hint
    assert len(results["fp32"].records) == 4
    s = {x.name: x for x in report.stages}
    assert s["amp"].error is not None and s["fp32"].error is None


def test_same_initial_weights_and_batches_in_every_stage() -> None:
    report, run = triage(SAMPLES / "healthy.py", TriageConfig(steps=3))
    results = run.results
    l32, l16, lamp = (results[s].records[0].loss for s in ("fp32", "fp16", "amp"))
    # step 0 sees the same weights and batch: losses agree to FP16 precision
    assert abs(l16 - l32) / l32 < 1e-2 and abs(lamp - l32) / l32 < 1e-2


def test_triage_log_is_the_scaler_csv(tmp_path: Path) -> None:
    from ampdoctor.watch.steplog import COLUMNS
    from ampdoctor.watch.steplog_read import read_step_log

    log = tmp_path / "steps.csv"
    r = CliRunner().invoke(app, ["triage", str(SAMPLES / "grad_overflow.py"), "--steps", "6", "--log", str(log), "-q"])
    assert r.exit_code == 1, r.output
    header = log.read_text().splitlines()[0].split(",")
    assert tuple(header[: len(COLUMNS)]) == COLUMNS
    steps = read_step_log(log)
    assert len(steps.frame) == 6
    assert steps.frame["skip_reason"].iloc[0] == "nonfinite_grad:head"
    assert list(steps.frame["scaler_scale"].iloc[:3]) == [65536.0, 32768.0, 16384.0]
    r = CliRunner().invoke(app, ["triage", str(SAMPLES / "grad_overflow.py"), "--steps", "2", "--log", str(log)])
    assert r.exit_code == 2 and "--force" in r.output


def test_outlier_batch_is_data(tmp_path: Path) -> None:
    """Targets x1e8 in one batch (the seed articles' loss-spike injection): finite in FP32, a skip in AMP."""
    spec = write_spec(tmp_path, """
import torch
from torch import nn
def build_model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
def build_dataloader():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(12):
        x = torch.randn(32, 16, generator=g)
        y = x.sum(1, keepdim=True)
        out.append((x, y * 1e8 if i == 9 else y))
    return out
def loss_fn(o, y):
    return nn.functional.mse_loss(o.float(), y)
""")
    report, _ = triage(spec, TriageConfig(steps=20))
    v = report.verdict
    assert (v.cause, v.first_module, v.first_step, v.stage) == ("data", None, 9, "amp"), v.summary
    ev = report.findings[0].evidence
    assert ev["field"] == "targets" and ev["ratio_to_median"] > 1e7


# issue 13: real specs, big inputs, bad input, corrupt weights -------------------------------------

ASSETS = Path(__file__).resolve().parent / "assets"


def test_spec_folder_stays_importable_while_its_functions_run() -> None:
    """build_model(), build_dataloader() and loss_fn() each `import` a module beside the spec lazily."""
    import sys

    sys.modules.pop("ampdoctor_lazy_helper", None)
    before = list(sys.path)
    report, run = triage(ASSETS / "lazy_import" / "spec.py", TriageConfig(steps=3, device="cpu"))
    assert report.verdict.cause == "healthy", report.verdict.summary
    assert len(run.results["amp"].records) == 3
    assert sys.path == before  # put back after the run
    sys.modules.pop("ampdoctor_lazy_helper", None)
    r = CliRunner().invoke(app, ["layers", str(ASSETS / "lazy_import" / "spec.py"), "--steps", "1", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "body" in r.output
    assert sys.path == before
    sys.modules.pop("ampdoctor_lazy_helper", None)


RAISES_AT_7 = GOOD_MODEL + """
def build_dataloader():
    for i in range(20):
        if i == 7:
            raise ValueError("corrupt record 7")
        yield torch.randn(4, 3), torch.randn(4, 1)
"""

MORE_BAD = {
    # (spec body, extra options, what the one line must say)
    "loader_raises_at_7": (RAISES_AT_7, ["--steps", "10"],
                           "spec.py:11: the dataloader raised ValueError while yielding batch 7: corrupt record 7"),
    "optimizer_none": (GOOD_MODEL + GOOD_DATA + "\ndef build_optimizer(params):\n    torch.optim.SGD(params, lr=0.1)\n",
                       ["--steps", "2"], "build_optimizer() returned None"),
    "optimizer_not_one": (GOOD_MODEL + GOOD_DATA + "\ndef build_optimizer(params):\n    return list(params)\n",
                          ["--steps", "2"], "build_optimizer() returned list, not an optimizer"),
    "steps_ten": (GOOD_MODEL + GOOD_DATA + '\nTRIAGE_OPTIONS = {"steps": "ten"}\n', [],
                  "--steps must be a whole number (got 'ten')"),
    "steps_1e21": (GOOD_MODEL + GOOD_DATA, ["--steps", str(10**21)], "is more than a triage takes"),
    "options_typo": (GOOD_MODEL + GOOD_DATA + '\nTRIAGE_OPTIONS = {"step": 5}\n', [],
                     "TRIAGE_OPTIONS has no option 'step'"),
    "steps_1e21_typed": (GOOD_MODEL + GOOD_DATA, ["--steps", "1e21"], "--steps takes a whole number such as 50 (got '1e21')"),
    "sys_exit": (GOOD_DATA + GOOD_MODEL + "\nimport sys\ndef build_model():\n    sys.exit(3)\n", ["--steps", "2"],
                 "build_model() called sys.exit(3)"),
    "integer_loss": (GOOD_MODEL + GOOD_DATA + "\ndef loss_fn(out, y):\n    return (out > y).sum()\n", ["--steps", "2"],
                     "the loss has dtype int64"),
    "loss_without_grad": (GOOD_MODEL + GOOD_DATA + "\ndef loss_fn(out, y):\n    return (out - y).abs().mean().detach()\n",
                          ["--steps", "2"], "the loss does not depend on the trainable weights"),
    "mixed_shapes": (GOOD_MODEL + "\ndef build_dataloader():\n    return [(torch.randn(4, 5 if i == 2 else 3), torch.randn(4, 1)) "
                     "for i in range(4)]\n", ["--steps", "4"],
                     "batch 2 does not run in FP32"),
    "nan_in_initial_weights": (GOOD_DATA + GOOD_MODEL + """
def build_model():
    m = torch.nn.Linear(3, 1)
    with torch.no_grad():
        m.weight[0, 1] = float("nan")
        m.bias.fill_(float("inf"))
    return m
""", ["--steps", "2"], "already non-finite: parameter weight (1 NaN), parameter bias (1 Inf)"),
}


@pytest.mark.parametrize("case", sorted(MORE_BAD))
def test_more_bad_input_one_line_exit_2(tmp_path: Path, case: str) -> None:
    body, extra, expected = MORE_BAD[case]
    spec = write_spec(tmp_path, body)
    res = CliRunner().invoke(app, ["triage", str(spec), "--device", "cpu", "-q", *extra])
    assert res.exit_code == 2, res.output
    assert expected in res.output, res.output
    assert "Traceback" not in res.output
    assert res.output.strip().startswith("error:") and len(res.output.strip().splitlines()) == 1


def test_mixed_layouts_name_both_batches(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, MORE_BAD["mixed_shapes"][0])
    res = CliRunner().invoke(app, ["triage", str(spec), "--device", "cpu", "-q", "--steps", "4"])
    assert "batch 2 holds inputs (4, 5) float32" in res.output
    assert "where batch 0 holds inputs (4, 3) float32" in res.output


def test_batch_size_and_sequence_length_may_vary(tmp_path: Path) -> None:
    """Only batches that fail in FP32 are refused: a short last batch and varying lengths are fine."""
    spec = write_spec(tmp_path, """
import torch
from torch import nn

class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 1)
    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))

def build_model():
    return Bag()

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 20, (4 if i < 5 else 2, 3 + i), generator=g), torch.randn(4 if i < 5 else 2, 1, generator=g))
            for i in range(6)]

def loss_fn(o, y):
    return nn.functional.mse_loss(o, y)
""")
    report, run = triage(spec, TriageConfig(steps=6, device="cpu"))
    assert report.verdict.cause == "healthy", report.verdict.summary
    assert [r.batch for r in run.results["fp32"].records] == [0, 1, 2, 3, 4, 5]


def test_prepare_leaves_the_initial_weights_as_built(tmp_path: Path) -> None:
    """The FP32 checks run forwards; BatchNorm statistics must still be those build_model() returned."""
    from ampdoctor.engine.triage import prepare
    from ampdoctor.input.spec import load_spec

    spec = write_spec(tmp_path, """
import torch
from torch import nn
def build_model():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
def build_dataloader():
    return [(torch.randn(8, 3) + 5, torch.randn(8, 1)) for _ in range(2)]
def loss_fn(o, y):
    return nn.functional.mse_loss(o, y)
""")
    model, _ = prepare(load_spec(spec), TriageConfig(steps=2, device="cpu"), torch.device("cpu"))
    bn = model[1]
    assert torch.equal(bn.running_mean, torch.zeros(4)) and torch.equal(bn.running_var, torch.ones(4))
    assert int(bn.num_batches_tracked) == 0


class _Counting:
    """A loader with a length that raises if more batches are drawn than the cache can hold."""

    def __init__(self, n: int, limit: int) -> None:
        self.n, self.limit, self.drawn = n, limit, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # noqa: ANN204
        for _ in range(self.n):
            self.drawn += 1
            if self.drawn > self.limit:
                raise AssertionError("drew a batch past the cache budget")
            yield torch.zeros(250, 4), torch.zeros(250, 1)  # 5000 bytes, 6024 with two tensors' overhead


def test_batch_cache_refuses_before_materialising_a_sized_loader() -> None:
    from ampdoctor.input.batches import CacheFullError, materialise

    loader = _Counting(3_000_000, limit=1)
    with pytest.raises(CacheFullError) as e:
        materialise(loader, 3_000_000, max_bytes=10**6)
    msg = str(e.value)
    assert "3000000 batches for --steps 3000000 need about 18.1 GB" in msg, msg
    assert "(6.0 kB per batch)" in msg and "lower --steps to at most 166" in msg
    assert loader.drawn == 1
    # a loader shorter than --steps is cycled: only its own batches count
    assert len(materialise(_Counting(150, limit=150), 3_000_000, max_bytes=10**6).items) == 150


def test_batch_cache_stops_an_endless_generator_at_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPDOCTOR_BATCH_CACHE_GB", "0.0001")  # 100 kB: 54 batches of 800 + 2 x 512 bytes
    spec = write_spec(tmp_path, GOOD_MODEL + """
import itertools
def build_dataloader():
    for i in itertools.count():
        if i > 200:
            raise AssertionError("drew a batch past the cache budget")
        yield torch.zeros(50, 4)[:, :3].contiguous(), torch.zeros(50, 1)
""")
    res = CliRunner().invoke(app, ["triage", str(spec), "--device", "cpu", "-q", "--steps", "3000000"])
    assert res.exit_code == 2, res.output
    assert "need about 5.5 GB of host memory (1.8 kB per batch)" in res.output, res.output
    assert "100.0 kB batch cache (AMPDOCTOR_BATCH_CACHE_GB=0.0001)" in res.output
    assert "lower --steps to at most 54" in res.output and "AMPDOCTOR_BATCH_CACHE_GB=7" in res.output


def test_views_of_one_storage_count_once() -> None:
    """Sliding windows over one token stream hold that stream, not windows x length."""
    from ampdoctor.input.batches import TENSOR_OVERHEAD, CacheFullError, materialise

    stream = torch.arange(1000, dtype=torch.int64)  # 8000 bytes
    windows = [(stream[i:i + 100], stream[i + 1:i + 101]) for i in range(500)]
    held = 8000 + 1000 * TENSOR_OVERHEAD
    assert len(materialise(windows, 500, max_bytes=held).items) == 500
    with pytest.raises(CacheFullError):
        materialise(windows, 500, max_bytes=held - 1)


@pytest.mark.parametrize("where", ["build", "first batch"])
def test_dataloader_timeout_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    import time

    monkeypatch.setenv("AMPDOCTOR_DATA_TIMEOUT", "0.5")
    body = GOOD_MODEL + ("""
import time
def build_dataloader():
    time.sleep(20)
    return [torch.randn(4, 3)]
""" if where == "build" else """
import time
def build_dataloader():
    time.sleep(20)
    yield torch.randn(4, 3), torch.randn(4, 1)
""")
    spec = write_spec(tmp_path, body)
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["triage", str(spec), "--device", "cpu", "-q", "--steps", "2"])
    assert time.monotonic() - t0 < 15
    assert res.exit_code == 2, res.output
    what = "build_dataloader()" if where == "build" else "the first batch of build_dataloader()"
    assert f"spec.py: {what} has not finished after 0.5 s" in res.output, res.output
    assert "AMPDOCTOR_DATA_TIMEOUT" in res.output and len(res.output.strip().splitlines()) == 1


def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ampdoctor.cli.progress as cp

    monkeypatch.setattr(cp, "EVERY_S", 0.0)
    monkeypatch.setattr(cp.LineProgress.__init__, "__defaults__", (0.0, cp.time.monotonic))
    spec = write_spec(tmp_path, GOOD_MODEL + GOOD_DATA)
    res = CliRunner().invoke(app, ["triage", str(spec), "--device", "cpu", "--steps", "3"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("ampdoctor:")]
    assert "ampdoctor: taking batches, 3/3" in "\n".join(lines), res.stderr
    assert any(ln.startswith("ampdoctor: stage amp, 3/3 (") for ln in lines), res.stderr
    assert "\x1b[" not in res.stderr


def test_progress_lines_are_throttled() -> None:
    from ampdoctor.cli.progress import LineProgress

    now = [0.0]
    seen: list[str] = []
    p = LineProgress(seen.append, total=100, every_s=10.0, clock=lambda: now[0])
    for step in range(100):
        now[0] = step * 0.5  # 2 steps a second: 50 s in all
        p("fp32", step)
    assert seen == [f"ampdoctor: stage fp32, {s + 1}/100 ({s // 2} s)" for s in (20, 40, 60, 80)]


def test_config_values_are_typed() -> None:
    from ampdoctor.errors import UsageError

    for bad, match in (({"steps": "ten"}, "--steps must be a whole number"), ({"steps": 2.0}, "--steps must be a whole number"),
                       ({"steps": True}, "--steps must be a whole number"), ({"init_scale": "big"}, "--init-scale must be a finite"),
                       ({"max_norm": float("nan")}, "--max-norm must be a finite"), ({"target": 16}, "--target must be a string"),
                       ({"stages": "fp32"}, "stages must be stage names")):
        with pytest.raises(UsageError, match=match):
            TriageConfig(**bad)  # type: ignore[arg-type]
    assert TriageConfig(init_scale=1024, max_norm=1).init_scale == 1024
