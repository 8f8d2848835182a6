"""Issue 13 items 1-2: compiled models, pickling a monitored model, and an unclosed Monitor's memory."""

from __future__ import annotations

import gc
import io
import subprocess
import sys
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.modules.module as tmod
from torch import nn

from ampdoctor import Monitor
from ampdoctor.engine.triage import triage
from ampdoctor.input.config import TriageConfig
from ampdoctor.watch.calls import watchers
from ampdoctor.watch.hooks import Hooks

ASSETS = Path(__file__).resolve().parent / "assets"


def tiny(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(32, 8)
    return model, x, x.sum(1, keepdim=True)


def run(mon: Monitor, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list:
    recs = []
    for _ in range(steps):
        with mon.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        recs.append(mon.step(loss))
    return recs


# torch.compile ------------------------------------------------------------------------------------
# backend="eager": dynamo traces the model (what met our hooks) without needing inductor's C compiler


def test_monitor_on_a_compiled_model_steps_and_names_the_parameter() -> None:
    model, x, y = tiny()
    gc.collect()
    assert not tmod._has_any_global_hook()  # no monitor of an earlier test left anything behind
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even torch's "global hooks on modules" warning
        with Monitor(compiled, opt, torch.amp.GradScaler("cpu", init_scale=256.0), inject_inf_at=1) as mon:
            recs = run(mon, compiled, x, y, 3)
    assert [r.skipped for r in recs] == [False, True, False]
    assert recs[1].nonfinite_params == ["0.weight"]  # not "_orig_mod.0.weight"
    assert recs[1].skip_reason == "nonfinite_grad:0"
    st = recs[0].stats
    assert st is not None and set(st.pgrad) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert st.act == {}  # inside dynamo's graph: activations are not watched
    assert recs[2].loss < recs[0].loss


def test_triage_of_a_compiled_model_is_not_a_model_bug() -> None:
    report, _ = triage(ASSETS / "compiled_spec.py", TriageConfig(steps=12))
    assert report.verdict.cause == "healthy", report.verdict


# pickling and memory ------------------------------------------------------------------------------


def test_a_monitored_model_pickles_without_ampdoctor() -> None:
    model, x, y = tiny()
    mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.01))
    run(mon, model, x, y, 2)
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
    buf = io.BytesIO()
    torch.save(model, buf)  # while the monitor is open, on a recorded step
    assert b"ampdoctor" not in buf.getvalue()
    mon.close()
    # loads where ampdoctor cannot be imported
    code = ("import sys, io, torch; sys.modules['ampdoctor'] = None; "
            "m = torch.load(io.BytesIO(sys.stdin.buffer.read()), weights_only=False); print(type(m).__name__, len(m))")
    out = subprocess.run([sys.executable, "-c", code], input=buf.getvalue(), capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split() == ["Sequential", "3"]
    sd = io.BytesIO()
    torch.save(model.state_dict(), sd)
    sd.seek(0)
    assert set(torch.load(sd, weights_only=True)) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_an_unclosed_monitor_does_not_keep_the_model_alive() -> None:
    model, x, y = tiny()
    mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.01))
    recs = run(mon, model, x, y, 2)  # stats records stay with the caller; they hold only numpy rows
    assert watchers() == 2  # recording the next step: the hooks, and the forecast's op watch (watch.opwatch)
    ref = weakref.ref(model)
    del model, mon  # a notebook cell run again: the old monitor is dropped without close()
    gc.collect()
    assert ref() is None
    assert watchers() == 0  # its watch on module calls went with it
    assert recs[1].stats is not None and recs[1].stats.act


def test_hooks_register_nothing_on_steps_not_recorded() -> None:
    model, x, _ = tiny()
    with Hooks(model, every=2) as h:
        h.begin_step(0)
        assert watchers() == 1
        model(x)
        st = h.end_step()
        h.begin_step(1)
        assert watchers() == 0
        model(x)
        assert len(h.end_step().calls) == 0
        h.begin_step(2)
        other = nn.Linear(8, 2)
        model(x), other(x)  # another model's module: filtered out
        assert [c.module for c in h.end_step().calls] == [c.module for c in st.calls]
    assert not tmod._has_any_global_hook()  # no flag left either
    assert [c.module for c in st.calls] == ["0", "1", "2", "<model>"]


def test_a_compiled_training_function_traces_through_the_call_wrapper() -> None:
    """The model is called inside a ``torch.compile``d function while the ``__call__`` wrapper is in place (and
    taken away on the steps not recorded): a graph per state of the wrapper, no graph break, no recompilation; the
    parameters are still watched."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, x, y = tiny()

    @torch.compile(backend="eager")
    def loss_of(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(m(x), y)

    with Monitor(model, torch.optim.SGD(model.parameters(), lr=0.01), every=2) as mon:
        recs = [mon.step(loss_of(model, x)) for _ in range(6)]
    # one graph per state of the wrapper: the hooks and the forecast's op watch (a Python tracker, listening only
    # while the hooks do: watch.opwatch.sync) on recorded steps, none on the others; each compiled once, then cached
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    assert not torch._dynamo.utils.counters["graph_break"]
    assert not torch._dynamo.utils.counters["recompiles"]
    assert recs[0].stats is not None and set(recs[0].stats.pgrad) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert watchers() == 0


def test_the_call_listeners_keep_the_written_contract() -> None:
    """``watch.calls``: the four listeners implement its protocols, and the wrapper tells a listener after each call,
    a tracker around it (leave only when enter said so), stops a listener that raised and hands it the error, and is
    taken away with the last listener."""
    from ampdoctor.watch.blame import GraphRecorder
    from ampdoctor.watch.calls import (
        CallListener,
        CallTracker,
        NativeListener,
        is_wrapped,
        listen_calls,
        track_calls,
        unlisten_calls,
    )
    from ampdoctor.watch.tap import ForwardTap
    from ampdoctor.watch.tracker import ModuleTracker

    model, x, _ = tiny()
    hooks, tracker, recorder = Hooks(model), ModuleTracker(model), GraphRecorder(model)
    tap = ForwardTap(model, None, inputs=False, on_start=lambda: None)
    assert isinstance(hooks, NativeListener) and isinstance(tap, CallListener) and isinstance(tap, CallTracker)
    assert isinstance(tracker, CallTracker) and isinstance(recorder, CallTracker)
    tap.close()
    recorder.remove()

    seen: list[tuple[str, str]] = []

    class Listener:
        def __init__(self, tag: str, fail_on: type[nn.Module] | None = None) -> None:
            self.tag, self.fail_on = tag, fail_on
            self.on_error = lambda e: seen.append(("error", f"{tag}: {e}"))

        def after_call(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            if self.fail_on is not None and isinstance(module, self.fail_on):
                raise RuntimeError("listener broke")
            seen.append((self.tag, type(module).__name__))

    class Tracker:
        def enter_call(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
            seen.append(("enter", type(module).__name__))
            return isinstance(module, nn.Linear)

        def leave_call(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            seen.append(("leave", type(module).__name__))

    lst, trk, bad = Listener("lst"), Tracker(), Listener("bad", fail_on=nn.ReLU)
    listen_calls(lst)
    track_calls(trk)
    listen_calls(bad)
    assert is_wrapped() and watchers() == 3
    out = model(x)
    assert seen == [("enter", "Sequential"),
                    ("enter", "Linear"), ("leave", "Linear"), ("lst", "Linear"), ("bad", "Linear"),
                    ("enter", "ReLU"), ("lst", "ReLU"), ("error", "bad: listener broke"),  # stopped, and told
                    ("enter", "Linear"), ("leave", "Linear"), ("lst", "Linear"),
                    ("lst", "Sequential")]  # no leave where enter_call said no; the user's forward went on
    assert out.shape == (32, 1) and watchers() == 2
    unlisten_calls(lst)
    unlisten_calls(trk)
    assert not is_wrapped() and watchers() == 0
