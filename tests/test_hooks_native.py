"""The C++ recorder (``fused``'s ``Tap``) gives exactly the records of the Python hooks it replaces:
the same calls with the same tensor ids, the same gradient arrival order, the same model inputs and
outputs, the same rows. Run on models whose calls take keyword arguments, return tuples, lists, dicts
and dict subclasses, call a module twice, run a part under no_grad and return integer tensors."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor.records import StepStats
from ampdoctor.watch import fused
from ampdoctor.watch.hooks import Hooks


@pytest.fixture(scope="module", autouse=True)
def _kernel() -> None:
    if fused.build_locked(wait=True) != 0:  # a finished build loads; one builder per machine (xdist workers)
        pytest.skip("no C++ compiler / ninja here: the C++ recorder cannot be built (the Python hooks are used)")


class Out(OrderedDict):  # a ModelOutput-like dict subclass
    pass


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.a(x) * gate
        return h, [self.b(h), torch.argmax(h, dim=-1)]  # an integer tensor: not watched


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.pair = Pair()
        self.norm = nn.LayerNorm(6)
        self.act = nn.GELU()
        self.side = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> Out:
        x = self.emb(ids)
        h, (z, _) = self.pair(x, gate=scale)
        y = self.act(self.norm(h + z))
        y = self.act(y)  # the same module twice
        with torch.no_grad():
            self.side(y)  # no gradient hook on what no_grad makes
        return Out(logits=self.head(y), hidden=y)


def _step(h: Hooks, model: Net, ids: torch.Tensor, scale: torch.Tensor, step: int) -> StepStats:
    h.begin_step(step)
    out = model(ids, scale)
    (out["logits"].square().mean() + out["hidden"].sum() * 0.01).backward()
    h.after_backward()
    h.after_step()
    st = h.end_step()
    model.zero_grad(set_to_none=True)
    return st


def _run(native: bool, flush_numel: int | None = None, steps: int = 2) -> list[StepStats]:
    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 10, (4, 5))
    scale = torch.rand(4, 5, 6, requires_grad=True)
    h = Hooks(model)
    if not native:
        h._start_native = lambda: None  # type: ignore[method-assign]
    if flush_numel is not None:
        h._buf.flush_numel = flush_numel
    with h:
        sts = [_step(h, model, ids, scale, i) for i in range(steps)]
    assert (h._tap is not None) == native
    return sts


def _same(a: StepStats, b: StepStats) -> None:
    assert [(c.module, c.inputs, c.outputs) for c in a.calls] == [(c.module, c.inputs, c.outputs) for c in b.calls]
    assert a.grad_order == b.grad_order
    assert (a.model_inputs, a.model_outputs) == (b.model_inputs, b.model_outputs)
    for kind in ("act", "grad", "pgrad", "param"):
        ra, rb = getattr(a, kind), getattr(b, kind)
        assert ra.keys() == rb.keys(), kind
        for k in ra:
            np.testing.assert_array_equal(ra[k], rb[k])


@pytest.mark.parametrize("how", ["call", "global"])
def test_the_cpp_recorder_gives_the_python_records(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the ``__call__`` wrapper and through the global forward hook (the fallback)."""
    monkeypatch.setenv("AMPDOCTOR_MODULE_HOOK", how)
    py, cc = _run(native=False), _run(native=True)
    for a, b in zip(py, cc, strict=True):
        _same(a, b)
    st = cc[1]
    assert [c.module for c in st.calls] == ["emb", "pair.a", "pair.b", "pair", "norm", "act", "act", "side", "head",
                                            "<model>"]
    side = next(c for c in st.calls if c.module == "side")
    assert side.outputs[0] not in st.grad  # made under no_grad: no gradient hook
    assert len(st.model_inputs) == 1  # the float input (scale); the ids are integers
    assert len(st.model_outputs) == 2 and st.grad_order[0] in st.model_outputs


def test_rows_made_in_cpp_equal_the_eager_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Activation and gradient rows are made in C++ as each tensor appears; the Python hooks with the eager
    statistics (no kernel at all) give the same rows."""
    cc = _run(native=True)
    monkeypatch.setenv("AMPDOCTOR_FUSED", "0")
    eager = _run(native=False)
    for a, b in zip(eager, cc, strict=True):
        _same(a, b)


def test_a_full_queue_is_drained_during_backward() -> None:
    """A queue holding a flush's worth of elements is handed over mid-step (from the gradient hook, with the
    GIL): the records are the same as with no limit."""
    for a, b in zip(_run(native=True), _run(native=True, flush_numel=64), strict=True):
        _same(a, b)
    for a, b in zip(_run(native=False, flush_numel=64), _run(native=True, flush_numel=64), strict=True):
        _same(a, b)


def _small(model: nn.Module, native: bool) -> tuple[nn.Module, torch.Tensor, Hooks]:
    """``model`` (seeded), an input, and Hooks on it: the C++ recorder, or (``native=False``) the Python one."""
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    h = Hooks(model)
    if not native:
        h._start_native = lambda: None  # type: ignore[method-assign]
    return model, torch.randn(2, 3), h


@pytest.mark.parametrize("native", [True, False])
def test_a_gradient_hook_left_from_an_earlier_step_records_nothing(native: bool) -> None:
    model, x, h = _small(nn.Sequential(nn.Linear(3, 3)), native)
    with h:
        h.begin_step(0)
        kept = model(x)  # its gradient hook belongs to step 0
        h.end_step()
        h.begin_step(1)
        model(x).sum().backward()
        kept.sum().backward()  # step 0's tensor, backward in step 1
        st = h.end_step()
    assert (h._tap is not None) == native
    assert st.grad_order == [1]  # step 1's output, once: step 0's output (also tid 1 then) records nothing


@pytest.mark.parametrize("native", [True, False])
def test_training_only_leaves_evaluation_forwards_out(native: bool) -> None:
    """What the framework callbacks set, possibly after recording started: an evaluation forward (eval mode,
    or no_grad) inside a recorded step is not recorded; a training forward is."""
    model, x, h = _small(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), native)
    with h:
        h.begin_step(0)
        h.training_only = True  # set while already listening
        model.eval()
        model(x)
        model.train()
        with torch.no_grad():
            model(x)
        model(x).sum().backward()
        st = h.end_step()
    assert (h._tap is not None) == native
    assert [c.module for c in st.calls] == ["0", "1", "<model>"]
    assert len(st.act) == 3 and len(st.grad) == 2  # input, two outputs; gradients of the two outputs


@pytest.mark.parametrize("how", ["call", "global"])
def test_the_tracker_names_the_module_an_exception_came_from(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.watch.calls import watchers
    from ampdoctor.watch.tracker import ModuleTracker

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    monkeypatch.setenv("AMPDOCTOR_MODULE_HOOK", how)
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Tanh(), Boom()))
    t = ModuleTracker(model)
    t.attach()
    model[0](torch.ones(1, 2))
    assert t.current is None  # a call that returned leaves nothing behind
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.ones(1, 2))
    assert t.current == "1.1" and t.stack == ["<model>", "1", "1.1"]
    t.detach()
    assert watchers() == 0


def test_a_compiled_submodule_keeps_the_global_hook() -> None:
    """Inside dynamo a wrapped ``__call__`` would be traced: a model with a compiled part is watched through the
    global forward hook instead, and its other modules are still recorded."""
    import torch.nn.modules.module as tmod

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), torch.compile(nn.Tanh(), backend="eager"), nn.Linear(3, 1))
    with Hooks(model) as h:
        h.begin_step(0)
        assert not h._wrap_call and len(tmod._global_forward_hooks) == 1
        model(torch.randn(2, 3)).sum().backward()
        st = h.end_step()
    assert {"0", "2", "<model>"} <= {c.module for c in st.calls}
    assert not tmod._global_forward_hooks


def test_a_steps_calls_are_the_same_list_objects_as_the_step_befores() -> None:
    """The recorder hands the calls' lists cached while their values repeat (the ring and the plan compare them
    by identity first): a take with nothing new in between (the hooks take several times a step) keeps them."""
    sts = _run(native=True, steps=3)
    (names1, mods1, bounds1, tids1), = sts[1].flat_calls
    (names2, mods2, bounds2, tids2), = sts[2].flat_calls
    assert mods1 and mods2 is mods1 and bounds2 is bounds1 and tids2 is tids1
    assert [c.module for c in sts[2].calls][-1] == "<model>"


class _InfBack(torch.autograd.Function):
    """Identity forward; backward makes the gradient at its input +inf where ``x > 0`` (an overflow in backward)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return torch.where(x > 0, torch.full_like(g, float("inf")), g)


class _Blow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfBack.apply(x) if self.on else x * 1.0


@pytest.mark.parametrize("native", [True, False])
def test_a_non_finite_gradient_row_is_found_whether_the_recorder_vouches_or_not(native: bool) -> None:
    """The C++ recorder says which kinds of rows it made and found finite (``StepStats.any_nonfinite`` then reads
    nothing); a gradient that overflows at a module's output is found all the same, by either recorder."""
    blow = _Blow()
    model, x, h = _small(nn.Sequential(nn.Linear(3, 6), blow, nn.Linear(6, 2)), native)
    with h:
        for step, on in enumerate((False, True, False)):
            blow.on = on
            h.begin_step(step)
            model(x).sum().backward()
            h.after_backward()
            st = h.end_step()
            model.zero_grad(set_to_none=True)
            assert st.any_nonfinite("grad") == on
            vouched = st.__dict__["_finite_kinds"]
            assert ("grad" in vouched) == (native and not on)  # (the Python recorder vouches for nothing)
            want = any(int(r[6] + r[7] + r[8]) > 0 for r in st.grad.values())  # the rows themselves, read
            assert want == on


def test_a_tensor_freed_in_the_forward_keeps_its_id_apart_from_the_next_one() -> None:
    """The id table holds a weak reference to each tensor it has seen: a tensor that dies mid-forward keeps its
    address until the step ends, so the next tensor made there cannot inherit its id (its row and gradient hook)."""

    class Churn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(20):  # a's output dies at once each time (only its sum is kept)
                x = x + self.a(x).sum() * 0.0
            return self.b(x)

    for native in (True, False):
        model, x, h = _small(Churn(), native)
        with h:
            h.begin_step(0)
            model(x).sum().backward()
            st = h.end_step()
        outs = [c.outputs[0] for c in st.calls if c.module == "a"]
        assert len(outs) == 20 and len(set(outs)) == 20  # twenty tensors, twenty ids
        assert all(t in st.act for t in outs)
