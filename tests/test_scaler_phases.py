"""GradScaler's normal working is not a failure (issue 28): calibration from ``init_scale``, the growth
probe after ``growth_interval`` clean steps, a back-off while the gradients grow (issue 45). Derived from GradScaler's state machine
(docs/diagnosis.md), checked on hand-made scale histories and on a real run with GradScaler's defaults."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ampdoctor import Monitor
from ampdoctor.capture.trigger import FailingStep


def _feed(rule: FailingStep, history: list[tuple[float, bool]]) -> list[tuple[int, str, str]]:
    """(scale used, skipped) per step -> (step, trigger reason or '', phase) for each step judged."""
    out = []
    for step, (scale, skipped) in enumerate(history):
        trig = rule.judge(skipped=skipped, reason="nonfinite_grad:m" if skipped else "", scale=scale, alert=False,
                          nonfinite=skipped, step=step)
        out.append((step, trig.reason if trig else "", rule.phase))
    return out


def test_calibration_from_init_scale_is_not_a_failure_nor_a_collapse() -> None:
    # 2^16 halving ten times until the gradients fit at 2^6, then clean: 10 binades fallen, never applied above
    hist = [(2.0 ** (16 - i), True) for i in range(10)] + [(2.0 ** 6, False)] * 20
    got = _feed(FailingStep(growth_interval=2000), hist)
    assert all(t == "" for _, t, _ in got)
    assert [p for _, _, p in got[:10]] == ["calibration"] * 10


def test_the_growth_probe_backing_off_is_not_a_failure_even_at_a_scale_seen_before() -> None:
    # 2^12 carried steps, then an isolated overflow there; back at 2^11 for growth_interval=4 clean steps, the scale
    # doubles to 2^12 and overflows again, twice (nanoGPT's pattern): GradScaler probing, each time
    probe = [(2.0**11, False)] * 4 + [(2.0**12, True)]
    hist = [(2.0**12, False)] * 3 + [(2.0**12, True)] + probe + probe
    got = _feed(FailingStep(growth_interval=4), hist)
    assert [t for _, t, _ in got] == [""] * len(hist)
    assert [p for _, _, p in got if p] == ["backoff", "growth_probe", "growth_probe"]
    # above every scale that ever carried a step it is calibration, whatever came before
    assert _feed(FailingStep(growth_interval=4), [(2.0**10, False)] * 4 + [(2.0**11, True)])[-1][2] == "calibration"


def test_back_offs_are_normal_however_often_and_a_jump_the_scale_does_not_explain_is_the_failure() -> None:
    # issue 45: the last applied step's largest scaled gradient sits near FP16's top (0.9 * 65504 at 1024): every
    # back-off while the gradients grow is GradScaler's work, the second within growth_interval too
    rule = FailingStep(growth_interval=100)
    g = 0.9 * 65504 / 1024
    for step in range(10):
        assert rule.judge(skipped=False, reason="", scale=1024.0, alert=False, step=step, grad_max=g) is None
    assert rule.judge(skipped=True, reason="nonfinite_grad:m", scale=1024.0, alert=False, nonfinite=True, step=10) is None
    assert rule.phase == "backoff"
    for step in range(11, 16):
        assert rule.judge(skipped=False, reason="", scale=512.0, alert=False, step=step, grad_max=0.9 * 65504 / 512) is None
    assert rule.judge(skipped=True, reason="nonfinite_grad:m", scale=512.0, alert=False, nonfinite=True, step=16) is None
    assert rule.phase == "backoff"
    # a step applied with the scaled gradients at 65504 / 2000: an overflow at the same scale needs 2000x growth
    rule.judge(skipped=False, reason="", scale=256.0, alert=False, step=17, grad_max=65504 / 256 / 2000)
    t = rule.judge(skipped=True, reason="nonfinite_grad:m", scale=256.0, alert=False, nonfinite=True, step=18)
    assert t is not None and (t.reason, t.why, t.first, rule.phase) == ("nonfinite_grad", "jump", None, "failure")
    assert t.need is not None and abs(t.need - 2000) < 1e-6


def test_every_skip_a_non_finite_loss_and_an_overflow_at_scale_one_are_failures() -> None:
    assert _feed(FailingStep(every_skip=True), [(1024.0, False), (1024.0, True)])[1][1] == "nonfinite_grad"
    rule = FailingStep()
    assert rule.judge(skipped=True, reason="nonfinite_loss", scale=2.0**16, alert=False, step=0).reason == "nonfinite_loss"
    # skips at 4, 2 (back-offs), then 1: at a scale <= 1 the unscaled gradients leave FP16; the failure starts at
    # the first skip of the run (nothing was applied since)
    hist = [(4.0, False)] * 3 + [(4.0, True), (2.0, True), (1.0, True)]
    rule = FailingStep()
    got = []
    for step, (scale, skipped) in enumerate(hist):
        got.append(rule.judge(skipped=skipped, reason="nonfinite_grad:m" if skipped else "", scale=scale, alert=False,
                              nonfinite=skipped, step=step, grad_max=None if skipped else 0.9 * 65504 / 4))
    assert got[:5] == [None] * 5
    t = got[5]
    assert t is not None and (t.reason, t.why, t.first) == ("nonfinite_grad", "unscaled", 3)


class _Loud(nn.Module):
    """Gradients far above FP16 at GradScaler's default 2^16 (calibration backs off ~12 binades), then a
    batch holding a NaN at step 150: the one real failure."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_with_gradscaler_defaults_the_capture_is_kept_for_the_real_failure(tmp_path: Path) -> None:
    model = _Loud()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    sc = torch.amp.GradScaler("cpu")  # every default: init_scale 2^16, growth_interval 2000
    g = torch.Generator().manual_seed(0)
    with Monitor(model, opt, sc, capture=tmp_path / "cap", alert_min_steps=20, quiet=True) as mon:
        recs = []
        for step in range(160):
            x = torch.randn(16, 8, generator=g)
            if step == 150:
                x[2, 1] = float("nan")
            with mon.autocast():
                loss = 3e4 * model(x).float().pow(2).mean()  # a loss summed, not averaged: scaled gradients overflow
            recs.append(mon.step(loss, batch=(x,)))
    calib = [r.step for r in recs if r.skipped]
    assert calib[0] == 0 and len(calib) >= 4 and calib[-1] == 150  # GradScaler calibrated, then the NaN batch
    assert mon.first_failure == (150, "nonfinite_loss")
    assert [r.step for r in recs if r.capture] == [150]
    assert mon.alert_rate_now < 0.05  # calibration skips are not the alert's


GROWTH_SPEC = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

def build_dataloader():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)]

def loss_fn(out, y):
    return 3e4 * nn.functional.mse_loss(out.float(), y)  # gradients near 1.7e4: a scale of 4 overflows FP16

def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-9)
'''


def test_a_forced_capture_of_the_growth_probe_is_triaged_healthy(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from ampdoctor.cli.app import app

    spec = tmp_path / "spec.py"
    spec.write_text(GROWTH_SPEC)
    ns: dict[str, object] = {}
    exec(GROWTH_SPEC, ns)
    model = ns["build_model"]()  # type: ignore[operator]
    opt = ns["build_optimizer"](model.parameters())  # type: ignore[operator]
    data = ns["build_dataloader"]()  # type: ignore[operator]
    sc = torch.amp.GradScaler("cpu", init_scale=2.0, growth_interval=10)  # fits at 2; the growth to 4 overflows
    for on in ("failure", "skip"):
        with Monitor(model, opt, sc, capture=tmp_path / on, capture_on=on, quiet=True) as mon:  # type: ignore[arg-type]
            recs = []
            for step in range(12):
                x, y = data[step % 8]  # type: ignore[index]
                with mon.autocast():
                    loss = ns["loss_fn"](model(x), y)  # type: ignore[operator]
                recs.append(mon.step(loss, batch=(x, y)))
        sc = torch.amp.GradScaler("cpu", init_scale=2.0, growth_interval=10)
        model = ns["build_model"]()  # type: ignore[operator]
        opt = ns["build_optimizer"](model.parameters())  # type: ignore[operator]
        assert [r.step for r in recs if r.skipped] == [10]
        if on == "failure":
            assert mon.first_failure is None and not (tmp_path / on).exists()  # GradScaler's probe: nothing captured
    m = json.loads((tmp_path / "skip" / "manifest.json").read_text())
    assert m["step"] == 10 and m["scaler_phase"] in ("calibration", "growth_probe")
    r = CliRunner().invoke(app, ["triage", str(spec), "--from", str(tmp_path / "skip"), "--json", "-", "-q"])
    rep = json.loads(r.stdout)
    assert r.exit_code == 0, r.output[-2000:]
    assert (rep["verdict"]["cause"], rep["verdict"]["first_step"], rep["verdict"]["first_module"]) == ("healthy", 10, "2")
    assert "GradScaler working as designed" in rep["verdict"]["summary"]
