"""One line to watch a DeepSpeed ZeRO-1/2 loop: ``watch(engine, ...)``.

::

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    mon = ampdoctor.integrations.deepspeed.watch(engine, log="steps.csv", capture="cap")
    for x, y in data:                                # the loop is unchanged
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    mon.close()

``watch`` wraps, on this engine only, ``engine.backward`` (to note each micro-batch's loss, divided by
the gradient accumulation steps as DeepSpeed divides it) and ``engine.step``: on a step at the gradient
accumulation boundary it calls ``Monitor.after_backward`` before DeepSpeed's step and
``Monitor.after_step`` after it; between boundaries it does nothing. Everything the step log says comes
from the engine, with no ``after_step(skipped=...)`` of yours:

- **the skip**: ``engine.was_step_applied()`` (``engine.optimizer.overflow``), after DeepSpeed's step;
- **the loss scale**: ``engine.optimizer.loss_scaler.cur_scale`` as the step's backward used it, and after
  the step (DeepSpeed's hysteresis: with ``hysteresis: 2`` the first overflow skips the step and keeps
  the scale; ``cur_hysteresis`` is written to the capture's manifest);
- **the gradients**: ZeRO-1/2 leave no ``p.grad``; each parameter's whole gradient is put together as
  ``deepspeed.utils.safe_get_full_grad`` does (this rank's fragment of the reduced gradients, zeros
  elsewhere, summed over the data-parallel ranks), every parameter in one all-reduce that every rank
  joins each step; it is still multiplied by the loss scale and is measured divided by it, so the global
  norm is ``engine.get_global_grad_norm()``'s. Nothing is written to a gradient, the optimizer or the
  scaler.

Names are the model's own (``engine.module``'s: ``embed.weight``, not ``module.embed.weight``). A capture
(``capture=``) is written by every rank (``cap.rank0``, ``cap.rank1`` ...): each holds its own piece of
the FP32 master weights and of the optimizer state (no collective, plain tensors: it loads with
``weights_only=True``), and ``ampdoctor triage SPEC --from cap.rank1`` reassembles the whole state on one
process, without DeepSpeed installed. ``close()`` restores both methods. Tested with DeepSpeed 0.19.8
on the CPU (``DS_ACCELERATOR=cpu``, gloo): ZeRO stages 1 and 2, fp16 and bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.capture.state import host_copy
from ampdoctor.capture.write import Capture
from ampdoctor.engine.monitor import Monitor, MonitorRecord
from ampdoctor.errors import UsageError
from ampdoctor.input.batches import cast_floating
from ampdoctor.parallel.deepspeed import Layout, fragment, layout_optimizer
from ampdoctor.report.alerts import Off, deepspeed_no_backward, deepspeed_replay_hint

ENGINE = "deepspeed"
"""The manifest's ``sharded`` of a DeepSpeed capture."""


def _check_engine(engine: Any) -> None:
    if type(engine).__name__ != "DeepSpeedEngine" and not any(c.__name__ == "DeepSpeedEngine" for c in type(engine).__mro__):
        raise UsageError(f"engine: watch takes the DeepSpeedEngine deepspeed.initialize returned, got {type(engine).__name__}")
    stage = int(engine.zero_optimization_stage())
    if stage not in (0, 1, 2, 3):
        raise UsageError(f"engine: ZeRO stage {stage}; ampdoctor.integrations.deepspeed reads ZeRO stages 1 and 2")
    if stage in (0, 3):
        return
    opt = getattr(engine, "optimizer", None)
    if opt is None or not hasattr(opt, "bit16_groups"):
        raise UsageError("engine: no ZeRO optimizer (give deepspeed.initialize an optimizer or an optimizer config)")


class _LossScale:
    """DeepSpeed's loss scaler, read the way the Monitor reads a GradScaler, and never written to.

    ``_scale`` and ``_growth_tracker`` are fresh tensors of DeepSpeed's Python numbers (no device state is
    shared); the growth tracker is the steps since the last overflow modulo ``loss_scale_window`` (DeepSpeed
    doubles the scale when it reaches the window)."""

    def __init__(self, scaler: Any) -> None:
        self.ds = scaler

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return float(self.ds.cur_scale)

    @property
    def _scale(self) -> torch.Tensor:
        return torch.tensor(float(self.ds.cur_scale), dtype=torch.float32)

    def tracker(self) -> int:
        window = max(1, int(getattr(self.ds, "scale_window", 1000)))
        return int(self.ds.cur_iter - self.ds.last_overflow_iter - 1) % window

    @property
    def _growth_tracker(self) -> torch.Tensor:
        return torch.tensor(self.tracker(), dtype=torch.int32)

    def get_growth_interval(self) -> int:
        return max(1, int(getattr(self.ds, "scale_window", 1000)))

    def get_growth_factor(self) -> float:
        return float(getattr(self.ds, "scale_factor", 2.0))

    def get_backoff_factor(self) -> float:
        return 1.0 / self.get_growth_factor()

    def _found_inf_per_device(self, optimizer: Any) -> dict[Any, torch.Tensor]:
        return {}  # DeepSpeed finds its overflow inside its step: the monitor reads the gradients themselves

    def state_dict(self) -> dict[str, Any]:
        """As a GradScaler's ``state_dict()`` (what a replay's GradScaler starts from)."""
        return {"scale": self.get_scale(), "growth_factor": self.get_growth_factor(),
                "backoff_factor": self.get_backoff_factor(), "growth_interval": self.get_growth_interval(),
                "_growth_tracker": self.tracker()}

    def _refuse(self, *a: Any, **k: Any) -> Any:
        raise RuntimeError("ampdoctor observes DeepSpeed's loss scaler and never drives it")

    scale = unscale_ = update = step = _refuse


class _Grad:
    """Stands for one parameter in the monitor's norms and rows: ``grad`` is its whole gradient for the step
    (read from DeepSpeed; ZeRO leaves ``p.grad`` empty), dropped after the step."""

    __slots__ = ("grad", "name", "shape")

    def __init__(self, name: str, shape: torch.Size) -> None:
        self.grad: torch.Tensor | None = None
        self.name = name
        self.shape = shape


class _Params:
    """What the monitor takes for an optimizer: the parameters it measures (``_Grad`` views) and the lr."""

    def __init__(self, engine: Any, grads: list[_Grad]) -> None:
        self.engine = engine
        self.param_groups: list[dict[str, Any]] = [{"params": grads, "lr": _lr(engine)}]

    def step(self, *a: Any, **k: Any) -> None:
        raise RuntimeError("ampdoctor observes DeepSpeed's optimizer and never steps it")

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _lr(engine: Any) -> float | None:
    try:
        lrs = engine.get_lr()
        return float(lrs[0]) if lrs else None
    except Exception:
        return None


class _RankCapture(Capture):
    """This rank's capture of a DeepSpeed run: its pieces of the FP32 master weights and of the optimizer
    state (``Layout.pieces``), the replicated buffers whole; the batches in FP32 (a replay runs the FP32
    master weights, under autocast)."""

    layout_ds: Layout
    view: _LossScale | None

    def state(self) -> dict[str, Any]:
        model, _, st = self.layout_ds.pieces()
        for n, b in self.model.named_buffers():
            model[n] = b
        groups = []
        i = 0
        for h, g in zip(self.layout_ds.hyper(), self.layout_ds.groups, strict=False):
            groups.append({**h, "params": list(range(i, i + len(g)))})
            i += len(g)
        return host_copy({"model": model, "optimizer": {"state": st, "param_groups": groups},
                          "scaler": self.view.state_dict() if self.view is not None else None})

    def before_update(self, step: int, batch: Any) -> None:
        super().before_update(step, _fp32(batch))

    def shards(self) -> dict[str, Any]:
        _, where, _ = self.layout_ds.pieces()
        for n, b in self.model.named_buffers():
            where[n] = {"shape": [int(x) for x in b.shape], "offset": [0] * b.dim()}
        return {"model": where, "optimizer_params": list(self.layout_ds.order)}

    def write(self, trig: Any, **kw: Any) -> Path | None:
        extra = dict(kw.pop("extra", None) or {})
        try:
            ls = self.view.ds if self.view is not None else None
            extra.update(shards=self.shards(), deepspeed={
                **self.settings.get("deepspeed", {}),
                "cur_hysteresis": int(ls.cur_hysteresis) if ls is not None and hasattr(ls, "cur_hysteresis") else None,
                "skipped_steps": int(getattr(self.layout_ds.engine, "skipped_steps", 0))})
        except Exception:  # the capture goes on without the pieces' places: the replay then says it cannot reassemble
            pass
        return super().write(trig, extra=extra, **kw)

    def replay_hint(self) -> str:
        from ampdoctor.capture.state import spec_hint

        return deepspeed_replay_hint(self.written, spec_hint() or "SPEC.py")


def _fp32(batch: Any) -> Any:
    """The batch with FP16/BF16 tensors in FP32 (a DeepSpeed fp16 loop feeds half inputs to a half model)."""
    from ampdoctor.input.batches import Micro, ModelInputs

    if batch is None:
        return None
    if isinstance(batch, Micro):
        return Micro([_fp32(b) for b in batch])
    if isinstance(batch, ModelInputs):
        return ModelInputs(tuple(_fp32(a) for a in batch.args), {k: _fp32(v) for k, v in batch.kwargs.items()})
    low = (torch.float16, torch.bfloat16)
    return cast_floating(batch, torch.float32) if _has(batch, low) else batch


def _has(b: Any, dtypes: tuple[torch.dtype, ...]) -> bool:
    from ampdoctor.tensors import iter_tensors

    return any(t.dtype in dtypes for t in iter_tensors(b))


class DeepSpeedMonitor(Monitor):
    """The Monitor ``watch`` returns (``close()`` also unwraps the engine). ``engine``: the DeepSpeedEngine."""

    engine_ds: Any
    _restore: list[str]
    _grads: list[_Grad]
    _module_params: list[nn.Parameter]
    _params_view: _Params
    _view: _LossScale | None
    _gas: int
    _pgrad_keys: list[Any]

    def close(self) -> None:
        eng = getattr(self, "engine_ds", None)
        for name in getattr(self, "_restore", []):
            eng.__dict__.pop(name, None)  # the class's own method shows through again
        self._restore = []
        for g in getattr(self, "_grads", []):
            g.grad = None
        super().close()

    def keep_batch(self, batch: Any) -> None:
        """This micro-batch as your spec's ``build_dataloader()`` yields it (e.g. ``(x, y)``), kept for the
        capture; call it once per micro-batch. The replay then runs whole steps (forward, your ``loss_fn``,
        backward); without it the capture keeps the inputs the model was called with, and the replay runs
        the forward alone."""
        self._keep_micro(batch)

    # the two points of DeepSpeed's step ------------------------------------------------------------
    def _read_grads(self, want: bool | None) -> None:
        """Each parameter's whole gradient (still times the loss scale), as ``safe_get_full_grad`` assembles it
        (this rank's fragment in place, zeros elsewhere, summed across the data-parallel ranks), for every
        parameter in one all-reduce of the model's size (FP32).

        Sentinel mode: first only each parameter's sum of squares and whether this rank records the step in full
        (``P + 1`` float64 in one all-reduce); each ``_Grad`` then holds one element, the parameter's global norm
        (what the norms, the sentinel and the skip read; no row is taken of it), and the model-sized all-reduce
        follows only when the reduced flag says a rank records this step, so every rank decides it from the same
        number. ``want``: this rank records the step in full (None: this rank turned off; it joins with zeros).
        Every rank joins the same collectives, also when reading its own fragments failed (it then adds zeros and
        turns off after them)."""
        params = self._module_params
        err: Exception | None = None
        if self.config.mode == "sentinel":
            sq = torch.zeros(len(params) + 1, dtype=torch.float64)
            try:
                if want is not None:
                    for i, p in enumerate(params):
                        frag, _ = fragment(p)
                        if frag is not None:
                            sq[i] = frag.double().square().sum()
                    sq[-1] = 1.0 if want else 0.0
            except Exception as e:  # (joined all the same, with zeros)
                err = e
                sq.zero_()
            self._all_reduce(sq)
            if not float(sq[-1]):
                if err is not None:
                    raise err
                for g, v in zip(self._grads, sq[:-1].sqrt().to(torch.float32).split(1), strict=True):
                    g.grad = v
                self.hooks._pgrad_keys = []  # type: ignore[attr-defined,misc]  # (no rows of a norm)
                return
        sizes = [p.numel() for p in params]
        buf = torch.zeros(sum(sizes), dtype=torch.float32, device=params[0].device if params else torch.device("cpu"))
        try:
            off = 0
            for p, n in zip(params, sizes, strict=True):
                frag, start = fragment(p) if want is not None and err is None else (None, 0)
                if frag is not None:
                    buf.narrow(0, off + start, frag.numel()).copy_(frag)
                off += n
        except Exception as e:  # (joined all the same, with zeros)
            err = e
            buf.zero_()
        self._all_reduce(buf)
        if err is not None:
            raise err
        for g, p, v in zip(self._grads, params, buf.split(sizes), strict=True):
            g.grad = v.view(p.shape)
        self.hooks._pgrad_keys = self._pgrad_keys  # type: ignore[attr-defined,misc]

    def _all_reduce(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            group = getattr(self._module_params[0], "_dp_group", None) if self._module_params else None
            dist.all_reduce(t, group=group if group is not None else self.engine_ds.optimizer.dp_process_group)

    def _before_step(self) -> None:
        if self.off is not None and not self._owe_exchange:
            return
        want: bool | None = None  # (a rank that turned off and owes the exchange joins the collectives, with zeros)
        try:
            self._params_view.param_groups[0]["lr"] = _lr(self.engine_ds)
            want = None if self.off is not None else bool(self.sentinel.scheduled(self.step_num))
        except Exception as e:
            self._fail("reading DeepSpeed's step", e)
        try:
            self._read_grads(want)
            if self._view is not None and self.off is None:
                self.recipe.hint_scale(self._view.get_scale())  # the scale this step's backward used
        except Exception as e:
            self._fail("reading DeepSpeed's gradients", e)
        self.after_backward(None)  # (off: only joins the exchange it owes)

    def _after_ds_step(self) -> MonitorRecord | None:
        for g in self._grads:
            g.grad = None
        if self.off is not None or self._pending is None:
            return None
        eng = self.engine_ds
        try:
            applied = bool(eng.was_step_applied())
            if self._view is not None:  # the scale after DeepSpeed's update (its hysteresis included)
                after = self._view.get_scale()
                self._pending.m.scale_after_if_applied = self._pending.m.scale_after_if_skipped = after
        except Exception as e:
            self._fail("reading DeepSpeed's step", e)
            return None
        return self.after_step(not applied)


def watch(engine: Any, *, log: str | Path | None = "ampdoctor/steps.csv", capture: str | Path | None = None,
          **monitor_kwargs: Any) -> DeepSpeedMonitor:
    """Attach a ``Monitor`` to a DeepSpeed engine (ZeRO-1/2, fp16, bf16 or fp32); returns it (``close()`` detaches).

    ``monitor_kwargs`` go to ``ampdoctor.Monitor`` (``every``, ``alert_rate``, ``activations`` ...); a capture is
    written by every rank (``capture_ranks="all"``: the replay reassembles all of them). DeepSpeed clips
    (``gradient_clipping``): ``max_norm`` is refused; fault injection is refused too (it would write into
    DeepSpeed's gradients)."""
    _check_engine(engine)
    for k in ("max_norm", "inject_inf_at", "inject_spike_at", "amp_dtype"):
        if monitor_kwargs.get(k) is not None:
            raise UsageError(f"{k}: not with DeepSpeed (it clips, casts and steps itself; ampdoctor only observes it)")
    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2):
        return _off(engine, Off("zero_stage", stage=stage), bool(monitor_kwargs.get("quiet", False)))
    monitor_kwargs.setdefault("capture_ranks", "all")
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
    module: nn.Module = engine.module
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for g in engine.optimizer.bit16_groups for p in g]
    grads = [_Grad(names[id(p)], p.shape) for p in params]
    fp16 = bool(engine.fp16_enabled())
    ls = getattr(engine.optimizer, "loss_scaler", None)
    view = _LossScale(ls) if fp16 and ls is not None else None
    amp = torch.float16 if fp16 else torch.bfloat16 if engine.bfloat16_enabled() else None
    opt = _Params(engine, grads)
    mon = Monitor(module, opt, view, log=log, capture=capture, amp_dtype=amp, **monitor_kwargs)  # type: ignore[arg-type]
    mon.__class__ = DeepSpeedMonitor  # the same object, with DeepSpeed's two points and a close() that unwraps
    assert isinstance(mon, DeepSpeedMonitor)
    mon.engine_ds = engine
    mon._grads = grads
    mon._module_params = params
    mon._params_view = opt
    mon._view = view
    mon._restore = []
    if mon.off is not None:
        return mon
    try:
        _route(mon, grads)
    except Exception as e:
        mon._fail("setting up the DeepSpeed integration", e)
        return mon
    if mon.capture is not None:
        cap = mon.capture
        cap.__class__ = _RankCapture
        assert isinstance(cap, _RankCapture)
        cap.layout_ds = Layout(engine, names)
        cap.view = view
        cap.sharded = ENGINE
        cap.optimizer = layout_optimizer(engine, cap.layout_ds)
        cap.settings.update(deepspeed={"zero_stage": int(engine.zero_optimization_stage()),
                                       "precision": "fp16" if fp16 else "bf16" if amp is not None else "fp32"})
    _wrap(mon, engine)
    return mon


def _wrap(mon: DeepSpeedMonitor, engine: Any) -> None:
    """``engine.backward`` notes each micro-batch's loss; ``engine.step`` at the accumulation boundary runs the
    monitor's two points around DeepSpeed's step (``close()`` restores both)."""
    backward, step = engine.backward, engine.step
    gas = max(1, int(engine.gradient_accumulation_steps() or 1))

    backwards = [0, 0]  # engine.backward calls since the last step at the boundary; times said it came without one

    def watched_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        backwards[0] += 1
        if mon.off is None and isinstance(loss, torch.Tensor):
            scale = gas if kwargs.get("scale_wrt_gas", True) else 1
            mon.note_loss(loss.detach() / scale if scale > 1 else loss)  # what DeepSpeed backpropagates
        return backward(loss, *args, **kwargs)

    def watched_step(*args: Any, **kwargs: Any) -> Any:
        if not engine.is_gradient_accumulation_boundary():
            return step(*args, **kwargs)  # an accumulation step: DeepSpeed does not step either
        if not backwards[0] and not backwards[1] and mon.off is None:
            backwards[1] = 1
            _no_backward(mon)
        backwards[0] = 0
        mon._before_step()
        try:
            return step(*args, **kwargs)
        finally:
            mon._after_ds_step()

    engine.backward = watched_backward
    engine.step = watched_step
    mon._restore = ["backward", "step"]


def _no_backward(mon: Monitor) -> None:
    """Said once (rank 0): a step at the boundary came with no ``engine.backward(loss)`` since the last one, so the
    loop called ``loss.backward()`` itself (DeepSpeed then neither scales the loss nor reduces the gradients as its
    ``backward`` does, and the monitor never sees the loss). The step log's loss is then NaN; nothing else changes."""
    if mon.rank not in (None, 0):
        return
    from ampdoctor.notify import alert

    alert(deepspeed_no_backward(), UserWarning, quiet=mon.quiet)


def _off(engine: Any, why: Off, quiet: bool) -> DeepSpeedMonitor:
    """A monitor that is off from the start, with one warning (from rank 0): it touches nothing of the engine
    (built on an empty module), and every call on it returns at once."""
    mon = Monitor(nn.Module(), None, None, log=None, distributed=False, quiet=quiet)
    mon.__class__ = DeepSpeedMonitor
    assert isinstance(mon, DeepSpeedMonitor)
    mon.engine_ds, mon._restore, mon._grads = engine, [], []
    mon._turn_off(why, warn=True, who=0)
    return mon


def _route(mon: DeepSpeedMonitor, grads: list[_Grad]) -> None:
    """The monitor's parameter names and per-layer gradient rows read the ``_Grad`` views (the model's own
    parameters hold no gradient under ZeRO)."""
    for g in grads:
        mon.recipe.names[id(g)] = g.name  # type: ignore[attr-defined]  # (the same dict as the monitor's; the ranks' exchange names them too)
    if mon.ranks is not None:
        mon.ranks.params = [g.name for g in grads]
    mon._pgrad_keys = mon.hooks._pgrad_keys = [(("pgrad", g.name), g) for g in grads]  # type: ignore[attr-defined,misc]


__all__ = ["DeepSpeedMonitor", "watch"]
