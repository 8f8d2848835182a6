"""The loss tap shared by the framework integrations (no framework needed)."""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor.integrations._attach import ForwardTap, inner_optimizer, output_loss


class WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.fc(x).pow(2).mean()}


def test_tap_reads_training_losses_once_and_ignores_evaluation() -> None:
    model = WithLoss()
    got: list[float] = []
    tap = ForwardTap(model, lambda loss: got.append(float(loss)), inputs=True)
    x = torch.ones(2, 4)
    model(x)
    with torch.no_grad():
        model(x)  # evaluation-style: not a training forward
    model.eval()
    model(x)
    model.train()
    assert len(got) == 1 and tap.take() is not None and tap.take() is None
    tap.close()
    model(x)
    assert len(got) == 1  # closed: nothing left on the process


def test_tap_sees_a_compiled_model_through_its_wrapper() -> None:
    model = WithLoss()
    nn.init.constant_(model.fc.weight, 0.5)  # the loss grows with the input whatever the RNG state (4, then 16)
    nn.init.zeros_(model.fc.bias)
    compiled = torch.compile(model, backend="eager")
    got: list[float] = []
    tap = ForwardTap(model, lambda loss: got.append(float(loss)), inputs=False)
    compiled(torch.ones(2, 4))
    compiled(torch.ones(2, 4) * 2)
    assert len(got) == 2  # inside dynamo the hook does nothing; the wrapper's call is seen, once each
    assert got[1] > got[0]
    tap.close()


def test_output_loss_and_inner_optimizer() -> None:
    assert output_loss({"loss": torch.tensor(1.0)}) is not None
    assert output_loss(torch.tensor(2.0)) is not None and output_loss(torch.ones(3)) is None
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)

    class Wrapper(torch.optim.Optimizer):  # accelerate's AcceleratedOptimizer is an Optimizer subclass too
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    assert inner_optimizer(Wrapper(opt)) is opt and inner_optimizer(opt) is opt and inner_optimizer(None) is None


def test_clip_observer_reads_the_return_value_and_leaves_the_call_alone(tmp_path: object) -> None:
    import warnings

    from ampdoctor.integrations._attach import Attached, ClipObserver

    wrapped = ClipObserver._wrappers.get("clip_grad_norm_")
    leaked = wrapped is not None and torch.nn.utils.clip_grad_norm_ is wrapped
    original = ClipObserver._originals["clip_grad_norm_"] if leaked else torch.nn.utils.clip_grad_norm_  # an earlier unclosed monitor's
    torch.manual_seed(0)
    model, other = nn.Linear(4, 3), nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = Attached(model, opt, None, amp_dtype=None, first_step=0, log=None, capture=None, loss_from_output=False,
                 monitor_kwargs={"quiet": True})
    assert torch.nn.utils.clip_grad_norm_ is not original and torch.nn.utils.clip_grad_norm_.__wrapped__ is original  # type: ignore[attr-defined]
    recs, norms = [], []
    for k in range(3):
        loss = (model(torch.ones(2, 4) * (1 + 10 * k))).pow(2).sum()
        loss.backward()
        other(torch.ones(2, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3)  # another model's clip: not this step's
        want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        got = torch.nn.utils.clip_grad_norm_((p for p in model.parameters()), float("inf"))  # a generator, as Lightning passes
        assert torch.equal(got, want)  # the caller's own result, untouched
        norms.append(float(got))
        a.monitor.note_loss(loss.detach())
        a.before_optimizer_step()
        opt.step()
        recs.append(a.after_optimizer_step(applied=True))
        opt.zero_grad()
        other.zero_grad()
    for r, want_norm in zip(recs, norms, strict=True):  # a clip to inf (the Trainer's with max_grad_norm=0): the same norm twice
        assert r is not None and r.grad_l2_pre_clip == want_norm and abs(r.grad_l2_post_clip - want_norm) < 1e-5 * want_norm
    loss = model(torch.ones(2, 4) * 50).pow(2).sum()
    loss.backward()
    total = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
    a.monitor.note_loss(loss.detach())
    a.before_optimizer_step()
    r = a.after_optimizer_step(applied=True)
    assert r is not None and r.grad_l2_pre_clip == float(total) > 1.0 and abs(r.grad_l2_post_clip - 1.0) < 1e-5
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)  # an empty generator still warns, as torch does
    assert any("empty generator" in str(x.message) for x in w)
    a.close()
    assert torch.nn.utils.clip_grad_norm_ is original  # restored with the last monitor
    ClipObserver.remove(lambda p, t: None)  # removing what was never added is nothing
    assert torch.nn.utils.clip_grad_norm_ is original


def test_a_clip_given_its_total_norm_is_observed_as_accelerate_1_16_clips() -> None:
    """accelerate 1.16's clip_grad_norm_ computes get_total_norm itself and calls clip_grads_with_norm_ once per
    device mesh: the total it hands over is the step's pre-clip norm; the monitor's own clip is not noted."""
    from ampdoctor import Monitor
    from ampdoctor.integrations._attach import Attached, ClipObserver

    original = torch.nn.utils.clip_grads_with_norm_
    torch.manual_seed(0)
    model, other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)), nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = Attached(model, opt, None, amp_dtype=None, first_step=0, log=None, capture=None, loss_from_output=False,
                 monitor_kwargs={"quiet": True})
    try:
        assert torch.nn.utils.clip_grads_with_norm_ is not original
        for k in range(3):
            loss = model(torch.ones(2, 4) * (1 + 10 * k)).pow(2).sum()
            loss.backward()
            other(torch.ones(2, 4)).sum().backward()
            params = list(model.parameters())
            total = torch.nn.utils.get_total_norm([p.grad for p in params])
            torch.nn.utils.clip_grads_with_norm_(params[:2], 1.0, total)  # one call per mesh, the same total
            torch.nn.utils.clip_grads_with_norm_(params[2:], 1.0, total_norm=total)
            torch.nn.utils.clip_grads_with_norm_(other.parameters(), 1e-3, torch.tensor(5.0))  # another model's
            a.monitor.note_loss(loss.detach())
            a.before_optimizer_step()
            opt.step()
            r = a.after_optimizer_step(applied=True)
            assert r is not None and r.grad_l2_pre_clip == float(total) > 1.0, (k, r)
            assert abs(r.grad_l2_post_clip - 1.0) < 1e-5  # measured after the clip
            opt.zero_grad()
            other.zero_grad()
        # a Monitor that owns the step clips with max_norm: its own clip is not a framework's, nobody is told
        seen: list[object] = []

        def listener(p: list[object], t: object) -> None:
            seen.append(t)

        ClipObserver.add(listener)
        own = nn.Linear(4, 3)
        own_opt = torch.optim.SGD(own.parameters(), lr=0.1)
        m = Monitor(own, own_opt, max_norm=1.0, quiet=True)
        rec = m.step(own(torch.ones(2, 4) * 30).pow(2).sum())
        m.close()
        ClipObserver.remove(listener)
        assert rec.grad_l2_pre_clip > 1.0 and abs(rec.grad_l2_post_clip - 1.0) < 1e-5 and seen == []
    finally:
        a.close()
    assert torch.nn.utils.clip_grads_with_norm_ is original  # restored with the last monitor


def test_clip_grad_norm_signature_errors_are_the_callers() -> None:
    from ampdoctor.integrations._attach import ClipObserver

    seen: list[object] = []
    ClipObserver.add(lambda p, t: seen.append(t))
    try:
        import pytest

        with pytest.raises(TypeError):
            torch.nn.utils.clip_grad_norm_(nn.Linear(2, 2).parameters())  # max_norm missing: torch's own error
        assert seen == []
    finally:
        ClipObserver._listeners.clear()
        ClipObserver.remove(lambda p, t: None)


def test_a_monitor_never_closed_is_not_kept_alive_by_the_clip_observer() -> None:
    import gc
    import weakref

    from ampdoctor.integrations._attach import Attached

    model = nn.Linear(4, 3)
    a = Attached(model, torch.optim.SGD(model.parameters(), lr=0.1), None, amp_dtype=None, first_step=0, log=None,
                 capture=None, loss_from_output=False, monitor_kwargs={"quiet": True})
    gone = weakref.ref(a)
    del a  # a run that died without close()
    gc.collect()
    assert gone() is None
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) > 0  # the wrapper still passes calls through
