"""Do no harm: with a Monitor attached, the run ends bit-identical to the same run without it.

For every optimizer as people use it (SGD with momentum; Adam and AdamW for-loop, foreach and fused),
GradScaler on and off, clipping on and off, gradient accumulation, full statistics or sentinel mode,
a capture armed or not, and a fault at a step hypothesis picks (a NaN loss whose gradients stay
finite, an Inf gradient, a NaN in the batch), the model's weights, the optimizer's state, the
scaler's state and the torch / numpy / python RNG states after the run are compared byte for byte.
The model has dropout and the loop draws random numbers, so any RNG ampdoctor consumed would show.

Two drivers:

- **observe** (``after_backward`` / ``after_step``, what every framework callback uses): the user's
  loop steps the optimizer; the reference is the same loop without the two calls. ampdoctor writes
  nothing the training reads.
- **owned** (``mon.step``): the reference is PyTorch's documented AMP recipe (``unscale_``, step,
  ``update``, ``zero_grad``), with a non-finite loss skipped by setting the found-inf flag (the
  Monitor's documented rule); without a GradScaler, a non-finite step is skipped.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ampdoctor import Monitor

STEPS = 6
OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam_forloop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw_forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}
FAULTS = ("none", "nan_loss", "inf_grad", "nan_batch")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _batch(step: int, micro: int, nan: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    if nan:
        x[1, 2] = float("nan")
    return x, y


def _run(opt_name: str, driver: str, *, scaler_on: bool, clip: bool, accum: int, mode: str, capture: Path | None,
         fault: str, fault_step: int, watched: bool, log: Path | None = None,
         extra: dict[str, Any] | None = None, steps: int = STEPS) -> dict[str, Any]:
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    model = _model()
    if fault == "hooked_overflow":  # the user's "guard against NaN": it hides the overflow below from GradScaler
        for p in model.parameters():
            p.register_hook(lambda g: torch.nan_to_num(g))  # noqa: AMP004  (the hook under test)
    opt = OPTIMIZERS[opt_name](model.parameters())
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaler_on else None
    mon = None
    if watched:
        mon = Monitor(model, opt, sc, mode=mode, full_every=3, full_after=1, capture=capture, snapshot_every=2, log=log,
                      max_norm=1.0 if clip and driver == "owned" else None, alert_min_steps=1, alert_rate=0.2, quiet=True,
                      **(extra or {}))
    for step in range(steps):
        torch.rand(1)  # the loop's own randomness (data augmentation, noise)
        np.random.rand()
        random.random()
        loss_sum = torch.zeros(())
        for micro in range(accum):
            x, y = _batch(step, micro, fault == "nan_batch" and step == fault_step and micro == 0)
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler_on):
                loss = nn.functional.mse_loss(model(x).float(), y) / accum
            if fault == "nan_loss" and step == fault_step and micro == accum - 1:
                loss = loss + float("nan")  # the loss is NaN, its gradients stay finite
            if fault == "hooked_overflow" and step == fault_step:
                loss = loss * 1e30  # its scaled FP16 gradients overflow; the hooks make them finite
            loss_sum = loss_sum + loss.detach()
            last = micro == accum - 1
            if driver == "owned" and mon is not None:
                if not last:
                    mon.backward(loss)
                continue
            (sc.scale(loss) if sc is not None else loss).backward()
            if mon is not None:
                mon.note_loss(loss)
        if fault == "inf_grad" and step == fault_step:
            if driver == "owned" and mon is not None:
                pass  # written below, between backward and the monitor's step (its own injection is fault injection)
            else:
                model[0].weight.grad[0, 0] = float("inf")  # type: ignore[index]
        if driver == "owned" and mon is not None:
            if fault == "inf_grad" and step == fault_step:
                mon.inject_inf_at = {mon.step_num}
                mon.inject_param = "0.weight"
            if accum > 1:
                mon.backward(loss)
                mon.step()
            else:
                mon.step(loss)
            continue
        if driver == "owned":  # the documented recipe, without ampdoctor
            if sc is not None:
                sc.unscale_(opt)
                if not torch.isfinite(loss_sum):  # a non-finite loss skips the step and backs the scale off
                    for t in sc._found_inf_per_device(opt).values():
                        t.fill_(1.0)
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                sc.step(opt)
                sc.update()
            else:
                finite = bool(torch.isfinite(loss_sum)) and all(
                    bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if finite:
                    opt.step()
            opt.zero_grad(set_to_none=True)
            continue
        # observe: the user's own step, the monitor's two calls around it
        if clip:
            if sc is not None:
                sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if mon is not None:
            mon.after_backward()
        if sc is not None:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        if mon is not None:
            mon.after_step()
        opt.zero_grad(set_to_none=True)
    if mon is not None:
        assert mon.off is None, mon.off
        mon.close()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict() if sc is not None else None,
            "torch_rng": torch.get_rng_state(), "np_rng": np.random.get_state()[1].tolist(), "py_rng": random.getstate()}


def _same(a: Any, b: Any, where: str = "") -> None:
    """Byte-for-byte equality of nested states (NaN equals NaN of the same bits)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.detach().reshape(-1).contiguous().view(torch.uint8).equal(b.detach().reshape(-1).contiguous().view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, where
    else:
        assert a == b, (where, a, b)


CASES = st.fixed_dictionaries({
    "scaler_on": st.booleans(), "clip": st.booleans(), "accum": st.sampled_from([1, 2]),
    "mode": st.sampled_from(["full", "sentinel"]), "capture": st.booleans(),
    "fault": st.sampled_from(FAULTS), "fault_step": st.integers(0, STEPS - 1),
})


@pytest.mark.parametrize("driver", ["observe", "owned"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=CASES)
def test_the_run_ends_bit_identical_with_the_monitor_attached(opt_name: str, driver: str, case: dict[str, Any],
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    if driver == "owned" and case["clip"]:
        case = {**case, "clip": False}  # the monitor's clip takes its own norm: compared apart, within rounding
    cap = tmp_path_factory.mktemp("cap") / "capture" if case["capture"] else None
    kw = {k: v for k, v in case.items() if k != "capture"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = _run(opt_name, driver, capture=None, watched=False, **kw)
        seen = _run(opt_name, driver, capture=cap, watched=True, **kw)
    _same(bare, seen)


@pytest.mark.parametrize("fault", FAULTS)
def test_every_fault_kind_with_fused_adamw_and_a_scaler(fault: str, tmp_path: Path) -> None:
    """The matrix's worst case spelled out: fused AdamW (the Trainer's default) skips only on found_inf == 1."""
    for step in (0, 3):
        kw = dict(scaler_on=True, clip=True, accum=1, mode="full", fault=fault, fault_step=step)
        bare = _run("adamw_fused", "observe", capture=None, watched=False, **kw)  # type: ignore[arg-type]
        seen = _run("adamw_fused", "observe", capture=tmp_path / f"cap{step}", watched=True, **kw)  # type: ignore[arg-type]
        _same(bare, seen)
        assert all(torch.isfinite(v).all() for v in seen["model"].values())  # the skip was real


@pytest.mark.parametrize("driver", ["observe", "owned"])
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw_foreach"])
def test_a_capture_of_an_applied_step_a_hook_hid_changes_nothing(opt_name: str, driver: str, tmp_path: Path) -> None:
    """The capture taken at an applied step (a gradient hook made the overflow finite, GradScaler applied it). Where
    the loop steps itself (observe) the monitor reads the gradients before unscale_ and takes the non-finite norm
    of finite float32-max gradients for GradScaler's skip (a capture later, or none), still changing nothing."""
    import json

    kw = dict(scaler_on=True, clip=False, accum=1, mode="full", fault="hooked_overflow", fault_step=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = _run(opt_name, driver, capture=None, watched=False, **kw)  # type: ignore[arg-type]
        seen = _run(opt_name, driver, capture=tmp_path / "cap", watched=True, **kw)  # type: ignore[arg-type]
    _same(bare, seen)
    if driver == "owned":
        m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
        assert (m["step"], m["skipped"]) == (3, False) and m["reason"] in ("hidden_overflow", "nonfinite_update")
        assert len(m["user_hooks"]) == 6  # one per parameter


def test_owned_clipping_matches_the_recipe_within_rounding() -> None:
    for opt_name in ("adamw_fused", "sgd_momentum"):
        kw = dict(scaler_on=True, clip=True, accum=1, mode="full", fault="nan_batch", fault_step=2)
        bare = _run(opt_name, "owned", capture=None, watched=False, **kw)  # type: ignore[arg-type]
        seen = _run(opt_name, "owned", capture=None, watched=True, **kw)  # type: ignore[arg-type]
        for k, v in bare["model"].items():
            torch.testing.assert_close(seen["model"][k], v, rtol=1e-5, atol=1e-6)
        _same(bare["scaler"], seen["scaler"])
        _same(bare["torch_rng"], seen["torch_rng"])


def test_a_full_disk_under_the_log_and_the_capture_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Fused AdamW, a NaN loss, and a disk that fills after two log rows: the log warns and stops, the capture
    cannot be written, and the run is still byte for byte the run without ampdoctor."""
    import errno
    import os

    from ampdoctor.capture import write as capture_mod
    from ampdoctor.watch import steplog

    from .test_hostile import Filling

    monkeypatch.setattr(steplog, "_open_raw", lambda path, mode: Filling(path, mode, room=400))

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(capture_mod, "_claim", full)
    kw = dict(scaler_on=True, clip=True, accum=1, mode="full", fault="nan_loss", fault_step=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bare = _run("adamw_fused", "observe", capture=None, watched=False, **kw)  # type: ignore[arg-type]
        seen = _run("adamw_fused", "observe", capture=tmp_path / "cap", watched=True, log=tmp_path / "steps.csv",
                    **kw)  # type: ignore[arg-type]
    said = " ".join(str(w.message) for w in caught) + caplog.text  # (quiet: the capture's words go to the logger)
    assert "rows of the step log" in said and "could not write the capture of step 3" in said  # said, not raised
    assert not (tmp_path / "cap").exists()
    _same(bare, seen)


@pytest.mark.parametrize("driver", ["observe", "owned"])
@pytest.mark.parametrize("fault", FAULTS)
def test_the_warm_up_path_while_the_kernel_builds_changes_nothing(driver: str, fault: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Full mode while the kernel builds runs sentinel checks only, then full statistics once it is ready (step 3)."""
    from ampdoctor.watch import fused

    monkeypatch.setenv("AMPDOCTOR_WARMUP", "sentinel")
    seen_steps = {"n": 0}

    def pending() -> bool:
        seen_steps["n"] += 1
        return seen_steps["n"] < 4

    monkeypatch.setattr(fused, "pending", pending)
    kw = dict(scaler_on=True, clip=False, accum=1, mode="full", fault=fault, fault_step=2)
    bare = _run("adamw_fused", driver, capture=None, watched=False, **kw)  # type: ignore[arg-type]
    seen = _run("adamw_fused", driver, capture=tmp_path / "cap", watched=True, **kw)  # type: ignore[arg-type]
    _same(bare, seen)
    assert seen_steps["n"] >= 4  # the warm-up ended inside the run


@pytest.mark.parametrize(("opt_name", "driver"), [
    (o, d) if (o, d) == ("adamw_fused", "observe") else pytest.param(o, d, marks=pytest.mark.slow)  # the rest: CI's -m slow
    for o in ("adamw_fused", "adam_forloop", "sgd_momentum") for d in ("observe", "owned")])
def test_the_lookback_ring_forecast_and_spike_trigger_change_nothing(opt_name: str, driver: str, tmp_path: Path) -> None:
    """The ring reads the optimizer's state (Adam's moments, SGD's momentum) and the forecast and a hair-trigger
    spike test run every step, a spike capture included, with the op watch on (``watch_ops``: a TorchFunctionMode over
    the sampled forwards): the run still ends bit-identical."""
    for fault in ("none", "nan_loss"):
        kw = dict(scaler_on=True, clip=False, accum=1, mode="full", fault=fault, fault_step=30, steps=48)
        bare = _run(opt_name, driver, capture=None, watched=False, **kw)  # type: ignore[arg-type]
        seen = _run(opt_name, driver, capture=tmp_path / f"cap-{fault}", watched=True,
                    extra={"ring": 24, "forecast_horizon": 10**6, "spike_sigmas": 0.5, "spike_window": 16,
                           "watch_ops": True},
                    **kw)  # type: ignore[arg-type]
        _same(bare, seen)
