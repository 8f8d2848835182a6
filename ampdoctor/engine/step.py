"""The one training step every path runs: triage stages, ``ampdoctor layers``, ``Monitor``.

A rung of the precision ladder (``ladder.Rung``) says how the step computes; ``TrainStep`` runs it in PyTorch's AMP order (the
loop around it, over batches and micro-batches, is ``engine.driver``)::

    zero_grad → forward + loss (under autocast) → loss check (on the device) → backward (scaled)
    → unscale_ → FP16 gradients copied to the FP32 master → global L2 norm and clip
    → ONE copy to the host (loss, norms, found-inf, scale, per-layer statistics)
    → optimizer step, or skip → scaler.update() (on the skip path too)

Host synchronisations: the one copy in ``measure``; ``GradScaler.step`` makes its own on applied
steps only (on a skipped step the recipe already knows and calls ``update`` without ``step``);
``apply(check_weights=True)`` and ``measure_updates`` (triage only) make one more each.

The recipe reads GradScaler's device-side state (``_scale``, ``_growth_tracker``,
``_found_inf_per_device``) to avoid the syncs of ``get_scale()``; these fields have been stable
since PyTorch 1.6, with fallbacks.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ampdoctor.engine.forward import forward_loss
from ampdoctor.errors import UsageError
from ampdoctor.judge import locate
from ampdoctor.ladder import FP32, Rung
from ampdoctor.parallel.exchange import SLOTS, RankExchange, RankView
from ampdoctor.parallel.pieces import Shards
from ampdoctor.records import StepStats, nonfinite
from ampdoctor.watch.fused import fused_norms
from ampdoctor.watch.hooks import Hooks
from ampdoctor.watch.model_view import local, named_modules, named_parameters, unwrap

# the owned step's clip, taken before the integrations observe ``torch.nn.utils``' clip functions
# (integrations._attach.ClipObserver): ampdoctor's own clip is not the framework's
_clip_with_norm = torch.nn.utils.clip_grads_with_norm_

@dataclass
class Measured:
    """What ``TrainStep.measure`` learned at the step's one host copy."""

    loss: float
    grad_l2_pre_clip: float
    grad_l2_post_clip: float
    skip: bool
    """The step must be skipped: a non-finite loss or gradient."""
    reason: str
    """'' | 'nonfinite_loss' | 'nonfinite_grad' | 'nonfinite_grad:<module>'"""
    scale: float | None
    """The loss scale this step used (None without a GradScaler)."""
    scale_after_if_applied: float | None
    scale_after_if_skipped: float | None
    lr: float | None
    bad_params: list[str]
    """Parameters whose gradient held NaN/Inf (all of them on recorded steps; else the first)."""
    bad_count: int
    stats: StepStats | None
    """The per-layer statistics (None on steps the hooks do not record)."""
    growth_tracker: int | None = None
    """GradScaler's growth tracker before this step (None without a GradScaler)."""
    tripped: bool = False
    """Sentinel mode, on a step the hooks did not record: a gradient norm is non-finite or beyond the format's max."""
    ranks: RankView | None = None
    """Under torch.distributed: which ranks saw a non-finite value at this step (see ``parallel.exchange``)."""
    will_skip: bool | None = None
    """What the step will do: with a GradScaler where the caller steps, GradScaler's own verdict (its
    found-inf flags: a non-finite loss with finite gradients is applied); else ``skip``."""


_SET_LATER: Any = None
"""A ``_Step`` field the part of the recipe that computes it sets (before any later part reads it)."""


@dataclass
class _Step:
    """What one ``measure`` carries from one part of the recipe to the next (device tensors, then host figures)."""

    observe: bool
    noted: torch.Tensor | float | None = None
    already: bool = False
    """GradScaler's found-inf flags were taken before ``measure`` (the caller's ``unscale_``)."""
    label: str = ""
    scaled: bool = False
    gparams: list[torch.nn.Parameter] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    idx_params: list[torch.nn.Parameter] | None = None
    """The parameters ``first_nonfinite`` indexes (sharded and reduced: all of the optimizer's)."""
    shard_sums: bool = False
    dev: torch.device = torch.device("cpu")
    per: torch.Tensor | None = None
    nbad: torch.Tensor = _SET_LATER
    first_bad: torch.Tensor = _SET_LATER
    sq: torch.Tensor | None = None
    pre: torch.Tensor = _SET_LATER
    """The measured global norm before the clip (the skip decision reads it)."""
    pre_out: torch.Tensor = _SET_LATER
    """The pre-clip norm reported: the caller's own where it clipped, else ``pre``."""
    post: torch.Tensor = _SET_LATER
    loss_ok: torch.Tensor = _SET_LATER
    loss_known: bool = False
    loss_val: torch.Tensor = _SET_LATER
    found: torch.Tensor = _SET_LATER
    found_by_norms: bool = True
    scale_t: torch.Tensor = _SET_LATER
    tracker: torch.Tensor = _SET_LATER
    lr: Any = None
    st: StepStats | None = None
    vals: list[float] = field(default_factory=list)
    exchanged: np.ndarray | None = None
    tripped: bool = False


_PACKED = ("loss", "grad_l2_pre_clip", "grad_l2_post_clip", "found_inf", "scale", "growth_tracker",
           "nonfinite_count", "first_nonfinite", "lr")


class TrainStep:
    """One training step under a ``Rung`` of the precision ladder, with optional ``Hooks``.

    Args:
        model: the model the forward runs (FP16 weights for the fp16 policies).
        optimizer: steps ``master`` when given (FP32 master weights), else the model's parameters.
            None: a loop that updates the weights by hand (the recipe measures, the caller updates;
            a GradScaler needs an optimizer to unscale).
        scaler: an enabled ``torch.amp.GradScaler`` (None without loss scaling).
        precision: the rung (compute dtype, weight dtype, master weights, loss scaling).
        hooks: per-layer statistics (queued during the step, copied with the step's scalars).
        max_norm: clip the global L2 norm to this (None: measure only).
        master: FP32 master parameters, parallel to ``model.parameters()`` (fp16 with master weights).
        names: parameter id → name, for the skip reason.
        sentinel: a format's max: on steps the hooks do not record, each gradient's L2 norm (taken
            for the global norm anyway) rides in the one host copy, and ``Measured.tripped`` says
            whether one is non-finite or beyond that max (the Monitor's sentinel mode).
        scheduler: an LR scheduler stepped after every optimizer step, as training loops do (also
            after a skipped one: the schedule follows the iterations).
        skip_nonfinite: skip the optimizer step when the loss or a gradient is non-finite (with a
            GradScaler it always is). False does what a plain loop does: it applies them.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        precision: Rung = FP32,
        hooks: Hooks | None = None,
        max_norm: float | None = None,
        master: Sequence[torch.nn.Parameter] | None = None,
        names: dict[int, str] | None = None,
        skip_nonfinite: bool = True,
        sentinel: float | None = None,
        scheduler: Any = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.precision = precision
        self.hooks = hooks
        self.max_norm = max_norm
        self.skip_nonfinite = skip_nonfinite or self.scaler is not None
        self.sentinel = sentinel
        self.scheduler = scheduler
        self._loss_sum: torch.Tensor | None = None
        self.master = list(master) if master is not None else None
        self.model_params = list(model.parameters())
        if optimizer is None and self.scaler is not None:
            raise UsageError("a GradScaler needs the optimizer (scaler.unscale_(optimizer)); pass it")
        self.params: list[torch.nn.Parameter] = ([p for g in optimizer.param_groups for p in g["params"]]
                                                 if optimizer is not None else list(model.parameters()))
        """What the optimizer steps: norms and clipping cover these."""
        named = unwrap(model)  # a compiled model: names without its ``_orig_mod.`` prefix
        self.names = names if names is not None else {id(p): n for n, p in named_parameters(named)}
        if self.master is not None:
            for (n, _), p32 in zip(model.named_parameters(), self.master, strict=True):
                self.names.setdefault(id(p32), n)
        for i, p in enumerate(self.params):
            self.names.setdefault(id(p), f"<optimizer param {i}>")
        self.modules = [n or locate.MODEL for n, _ in named_modules(named)]
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._loss_ok: torch.Tensor | None = None
        self.grad_inv_scale: float | None = None
        """This step's parameter gradients still carry the loss scale (observe mode, before ``unscale_``):
        their statistics are taken times this, 1 / the scale the last host copy foretold (``_scale_hint``)."""
        self.grads_scaled = False
        """The last ``measure`` read gradients that still carried the loss scale (observe mode, before ``unscale_``)."""
        self._scale_hint: float | None = self.scaler.get_scale() if self.scaler is not None else None
        """The scale GradScaler will use at the next step, from this step's host copy (no sync to learn it;
        before the first step, GradScaler's ``init_scale`` or loaded state)."""
        self.ranks: RankExchange | None = None
        """Under torch.distributed: the per-step exchange of every rank's local faults (the Monitor sets it)."""
        self.clip_norm: torch.Tensor | float | None = None
        """Observe mode: the total norm the caller's ``clip_grad_norm_`` returned this step, before it clipped
        (``Monitor.note_clip``): the next ``measure`` reports it as the pre-clip norm, its own measurement
        (after that clip) as the post-clip norm. Read, never written; cleared by ``measure``."""
        self.shards: Shards | None = None
        """A sharded model (FSDP1/FSDP2/tensor parallelism): gradients are read as this rank's pieces, and with
        ``ranks`` their norms and rows are reduced across the ranks in the exchange (the Monitor sets it)."""
        self.ring_figures: Callable[[list[torch.nn.Parameter], torch.Tensor], tuple[Any, torch.Tensor]] | None = None
        """On recorded steps: per-parameter figures (a layout, values on the device) queued into the one host copy
        (``Hooks.add_tail``; the Monitor's lookback ring, ``engine.ring.RingFigures``)."""

    @property
    def reduced(self) -> bool:
        """Norms and parameter rows are the whole model's: not sharded, or sharded and reduced across ranks."""
        return self.shards is None or self.ranks is not None

    def hint_scale(self, scale: float | None) -> None:
        """The scale this step's backward used, from a caller that knows it (an engine's own loss scaler)."""
        self._scale_hint = scale

    # the forward -------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` with the rung's compute dtype on the model's device (disabled without one)."""
        return self.precision.autocast_on(self.device)

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        if self.master is not None:  # the FP16 model's own gradients
            self.model.zero_grad(set_to_none=True)

    def forward(self, batch: Any, loss_fn: Callable[..., Any] | None, zero_grad: bool = True) -> torch.Tensor:
        """zero_grad (unless accumulating), then the forward and the loss of one batch (already on the
        device) under autocast."""
        if zero_grad:
            self.zero_grad()
        return forward_loss(self.model, batch, loss_fn, self.precision)[1]

    # backward and the one copy -------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """The loss check (on the device, acted on at the one copy), then the (scaled) backward."""
        self.note_loss(loss)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def note_loss(self, loss: torch.Tensor) -> None:
        """Check the loss for NaN/Inf on the device (for loops that run backward themselves).

        Called once per micro-batch when gradients accumulate: the step's loss is their sum (each
        micro-batch's loss already divided by the number of micro-batches, as loops do)."""
        d = loss.detach().reshape(())
        ok = torch.isfinite(d)
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok & ok
        self._loss_sum = d.float() if self._loss_sum is None else self._loss_sum + d.float()

    def scaler_found(self) -> dict[Any, torch.Tensor]:
        """GradScaler's per-device found-inf flags (empty before ``unscale_``)."""
        if self.scaler is None or self.optimizer is None:
            return {}
        try:
            return dict(self.scaler._found_inf_per_device(self.optimizer))
        except (AttributeError, KeyError):  # pragma: no cover - future PyTorch
            return {}

    def measure(self, loss: torch.Tensor | None, before_unscale: Callable[[], str] | None = None, *,
                observe: bool = False) -> tuple[Measured, str]:
        """unscale_ → master gradients → norms and clip → the step's one host copy → skip decision.

        ``before_unscale`` runs between backward and ``unscale_`` (fault injection) and returns a
        label. Returns the measurement and that label.

        ``observe=True``: the caller (the user's loop, a framework) steps the optimizer, so the recipe
        writes nothing the training reads: no ``unscale_`` (gradients still carrying the loss scale are
        measured divided by it), no clipping, no write to GradScaler's found-inf flags; the skip it
        reports is the one GradScaler will make. Otherwise the recipe owns the step (PyTorch's AMP
        recipe): it unscales, clips, and a non-finite loss forces the skip by *setting* the found-inf
        flag to 1 (fused optimizers skip only on exactly 1).
        """
        s = self._unscale(before_unscale, observe)
        self._norms(s)
        self._loss_of_step(s, loss)
        self._found(s)
        self._host_copy(s)
        if s.shard_sums and s.exchanged is not None:
            self._whole_model(s)
        return self._measured(s), s.label

    def _unscale(self, before_unscale: Callable[[], str] | None, observe: bool) -> _Step:
        """The fault injection's label, then ``unscale_`` (the owned path) and the FP32 master gradients."""
        sc = self.scaler
        s = _Step(observe=observe)
        s.noted, self.clip_norm = self.clip_norm, None
        s.already = bool(self.scaler_found()) if sc is not None else False
        s.label = before_unscale() if before_unscale is not None else ""
        if observe and self.max_norm is not None:
            raise UsageError("max_norm clips inside Monitor.step(), which owns the step; where your loop steps the "
                             "optimizer, clip it yourself (after scaler.unscale_) and leave max_norm out")
        s.scaled = sc is not None and not s.already and observe  # gradients still carry the loss scale
        if sc is not None and not s.already and self.optimizer is not None and not observe:
            sc.unscale_(self.optimizer)
        self.grad_inv_scale = None
        self.grads_scaled = s.scaled
        if s.scaled and self.hooks is not None and self.hooks.recording:
            assert sc is not None
            if self._scale_hint is None:
                self._scale_hint = sc.get_scale()  # (a sync, once: afterwards the last host copy tells it)
            self.grad_inv_scale = 1.0 / self._scale_hint
        if self.master is not None:
            for p32, p16 in zip(self.master, self.model_params, strict=True):
                p32.grad = None if p16.grad is None else p16.grad.float()
        return s

    def _norms(self, s: _Step) -> None:
        """Global L2 norm over the optimizer's parameters (per-parameter norms in float32: an FP16 gradient's
        norm would overflow before its elements do), the count of non-finite ones, and the clip."""
        sc, sh = self.scaler, self.shards
        gparams: list[torch.nn.Parameter] = []
        grads: list[torch.Tensor] = []
        for p in self.params:  # (one read of each .grad: a property, on hundreds of parameters a step)
            g = p.grad
            if g is not None:
                gparams.append(p)
                grads.append(g if sh is None else local(g))
        s.gparams = gparams
        s.grads = grads
        s.shard_sums = sh is not None and self.ranks is not None  # the norms are reduced across the ranks at the host copy
        dev = s.dev = grads[0].device if grads else self.device
        if grads:
            per = None
            hooks = self.hooks
            if hooks is not None and sh is None and not s.scaled and (self.max_norm is None or s.observe):
                # a recorded step whose gradients stay as they are until its copy: their rows and norms in one read
                per = hooks.grads_with_norms(self.params, grads)
            if per is None and dev.type == "cpu":
                per = fused_norms(grads)  # one C++ call on the CPU (watch.fused)
            if per is None:
                norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
                per = torch.stack(norms if all(n.device == dev for n in norms) else [n.to(dev) for n in norms])
            if s.scaled:  # the norms GradScaler's unscale_ would give, from the scaled gradients (nothing written)
                inv = getattr(sc, "_scale", None)
                inv_t = (inv.double().reciprocal().float() if inv is not None
                         else torch.full((), 1.0 / sc.get_scale(), device=dev))  # type: ignore[union-attr]
                per = per * inv_t.to(per.device)
            s.per = per
            pre = torch.linalg.vector_norm(per, 2.0)
            bad = ~torch.isfinite(per)
            s.nbad = bad.sum()
            s.first_bad = bad.to(torch.float32).argmax()
        else:
            pre = torch.zeros((), device=dev)
            s.nbad = s.first_bad = torch.zeros((), device=dev)
        if s.shard_sums:
            assert sh is not None
            present = [i for i, p in enumerate(self.params) if p.grad is not None]
            s.sq = sh.sums(s.per, present, dev)  # this rank's sums of squares, one per parameter (replicas: 0)
        if self.max_norm is not None and grads and not s.observe and not s.shard_sums:
            _clip_with_norm(s.gparams, self.max_norm, pre)
            s.post = pre * torch.clamp(self.max_norm / (pre + 1e-6), max=1.0)
        else:
            s.post = pre
        s.pre = s.pre_out = pre
        noted = s.noted
        if s.observe and noted is not None and not s.scaled:  # the caller clipped: its own pre-clip norm, ours after it
            s.pre_out = (local(noted).detach().reshape(()).to(dev) if isinstance(noted, torch.Tensor)  # (FSDP2's: a DTensor)
                     else torch.full((), float(noted), device=dev))

    def _loss_of_step(self, s: _Step, loss: torch.Tensor | None) -> None:
        """The step's loss: the sum over its micro-batches when gradients accumulated, else the one given."""
        dev = s.dev
        s.loss_ok = self._loss_ok if self._loss_ok is not None else torch.ones((), dtype=torch.bool, device=dev)
        loss_sum = self._loss_sum
        self._loss_ok = self._loss_sum = None
        s.loss_known = loss_sum is not None or loss is not None
        if loss_sum is not None:
            s.loss_val = loss_sum
        else:
            s.loss_val = loss.detach().reshape(()) if loss is not None else torch.full((), float("nan"), device=dev)

    def _found(self, s: _Step) -> None:
        """The skip decision, on the device: the scaler's found-inf (plus a non-finite loss), else ours."""
        sc, dev = self.scaler, s.dev
        if sc is not None:
            fi = self.scaler_found()
            # set, never add: every optimizer GradScaler drives (fused Adam/AdamW too) skips on found_inf == 1
            force: torch.Tensor | None = None
            if s.label.startswith("inf") and s.already:  # an injected Inf after the flags were taken (asked for)
                force = torch.ones((), device=dev)
            elif not s.observe:  # the recipe owns the step: a non-finite loss skips it and backs the scale off
                force = (~s.loss_ok.to(dev)).to(torch.float32)
            if force is not None:
                for t in fi.values():
                    torch.maximum(t, force.to(t.device, t.dtype), out=t)
            s.found = torch.stack([t.to(dev, torch.float32) for t in fi.values()]).sum() if fi else (s.nbad > 0).float()
            s.found_by_norms = not fi
            s_dev: torch.Tensor | None = getattr(sc, "_scale", None)
            t_dev: torch.Tensor | None = getattr(sc, "_growth_tracker", None)
            s.scale_t = s_dev if s_dev is not None else torch.full((), sc.get_scale(), device=dev)
            s.tracker = t_dev if t_dev is not None else torch.zeros((), device=dev)
        else:
            s.found = ((~torch.isfinite(s.pre)) | (~s.loss_ok.to(dev))).to(torch.float32)
            s.found_by_norms = True
            s.scale_t = s.tracker = torch.full((), float("nan"), device=dev)

    def _host_copy(self, s: _Step) -> None:
        """The step's one host copy: the packed scalars, with the per-layer statistics on recorded steps, each
        gradient's norm in sentinel mode, and the ranks' exchange under torch.distributed."""
        dev = s.dev
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer is not None and self.optimizer.param_groups else None
        s.lr = lr
        lr_t = lr if isinstance(lr, torch.Tensor) else torch.full((), float("nan"), device=dev)
        packed = torch.stack([t.detach().reshape(()).to(dev, torch.float64) for t in
                              (s.loss_val, s.pre_out, s.post, s.found, s.scale_t, s.tracker, s.nbad, s.first_bad, lr_t)])
        hooks = self.hooks
        if hooks is not None and hooks.recording:
            self._recorded_copy(s, hooks, packed)
            return
        rx = self.ranks
        parts = [packed]
        nper = 0
        if self.sentinel is not None and s.per is not None and not s.shard_sums:  # each gradient's L2 norm (no extra pass)
            parts.append(s.per.to(packed.device, torch.float64))
            nper = s.per.numel()
        if rx is not None:
            parts.append(rx.exchange(rx.local_row(dev, s.loss_ok, s.nbad, s.first_bad), s.sq).to(packed.device))
        host = (torch.cat(parts) if len(parts) > 1 else packed).cpu().numpy()
        if nper:
            gnorms = host[len(_PACKED): len(_PACKED) + nper]
            s.tripped = bool(not np.isfinite(gnorms).all() or (gnorms > self.sentinel).any())
        if rx is not None:
            s.exchanged = host[len(_PACKED) + nper:]
        s.vals = host[: len(_PACKED)].tolist()

    def _recorded_copy(self, s: _Step, hooks: Hooks, packed: torch.Tensor) -> None:
        """A recorded step's host copy: the hooks' rows and the packed scalars (and the exchange) together."""
        rx, sh, sq, dev = self.ranks, self.shards, s.sq, s.dev
        hooks.after_backward(self.grad_inv_scale)  # parameter gradients, as the optimizer will see them
        # the weights this step's forward used: queued before the update, so StepStats.param holds them
        hooks.after_step()
        hooks.add_scalars(_PACKED, packed)
        if self.ring_figures is not None and s.per is not None:
            hooks.add_tail(*self.ring_figures(s.gparams, s.per))
        cur = hooks.current

        def exchange(keys: list[Any], rows: torch.Tensor) -> torch.Tensor:
            assert rx is not None
            row = rx.local_row(dev, s.loss_ok, s.nbad, s.first_bad, cur, keys, rows)
            if sq is None:
                return rx.exchange(row)
            assert sh is not None
            sums, maxes = sh.tables(keys, rows)  # the parameter rows, reduced in the same collective
            return rx.exchange(row, torch.cat([sq, sums.to(sq.device)]), maxes)

        st: StepStats | None = hooks.end_step(None if rx is None else exchange)  # the one host copy
        assert st is not None
        s.st = st
        s.vals = [st.extra[n] for n in _PACKED]
        s.exchanged = hooks.exchanged

    def _whole_model(self, s: _Step) -> None:
        """A sharded model: the whole model's norms from every rank's sums of squares (what clip_grad_norm_
        computes), its clip by the global factor, and the skip from them."""
        sh, rx, sc, exchanged = self.shards, self.ranks, self.scaler, s.exchanged
        assert sh is not None and rx is not None and exchanged is not None
        loss_f, pre_f, post_f, found_f, scale_f, tracker_f, nbad_f, first_f, lr_f = s.vals
        n0 = rx.world * SLOTS
        g = np.asarray(exchanged[n0: n0 + len(self.params)], dtype=np.float64)
        per_g = np.sqrt(g)
        clipped_by_caller = s.observe and s.noted is not None and not s.scaled  # pre_f: the caller's clip_grad_norm_
        total_f = float(np.sqrt(g.sum()))
        post_f = total_f
        pre_f = pre_f if clipped_by_caller else total_f
        badv = ~np.isfinite(per_g)
        nbad_f, first_f = float(badv.sum()), float(np.argmax(badv)) if badv.any() else 0.0
        s.idx_params = self.params
        if self.max_norm is not None and s.gparams and not s.observe:
            coef = torch.clamp(self.max_norm / (torch.tensor(pre_f, dtype=torch.float32) + 1e-6), max=1.0)
            torch._foreach_mul_(s.grads, coef.to(s.dev))  # every rank scales its pieces by the global factor
            post_f = pre_f * min(1.0, float(self.max_norm / (np.float32(pre_f) + 1e-6)))
        if sc is None:  # the whole model's gradients, and this rank's loss
            found_f = float(nbad_f > 0 or not math.isfinite(total_f) or (s.loss_known and not math.isfinite(loss_f)))
        elif s.found_by_norms:  # GradScaler has not unscaled yet: the global norms say what it will find
            found_f = float(nbad_f > 0)
        if s.st is None and self.sentinel is not None:
            s.tripped = bool(badv.any() or (per_g > self.sentinel).any())
        if s.st is not None:
            n1 = n0 + len(self.params)
            ns, nm = sh.sizes(True)
            sh.apply(s.st, exchanged[n1: n0 + ns], exchanged[n0 + ns: n0 + ns + nm])
        s.vals = [loss_f, pre_f, post_f, found_f, scale_f, tracker_f, nbad_f, first_f, lr_f]

    def _measured(self, s: _Step) -> Measured:
        """The host's figures into the step's verdict: skip or not, why, which parameters, the scale after."""
        sc, st, lr = self.scaler, s.st, s.lr
        loss_f, pre_f, post_f, found_f, scale_f, tracker_f, nbad_f, first_f, lr_f = s.vals
        lr_out = float(lr) if isinstance(lr, (int, float)) else (lr_f if isinstance(lr, torch.Tensor) else None)
        skip = found_f > 0 or (s.loss_known and not math.isfinite(loss_f))  # no loss given: NaN in the log, not a skip
        # what the step will do: GradScaler skips on its found-inf alone where the caller steps (observe)
        will_skip = (found_f > 0) if (s.observe and sc is not None) else skip
        # which parameters, and which module, held the non-finite gradients
        # (whether the step's parameter gradients were recorded matters only where a norm is non-finite or the
        # step is skipped: the question walks the step's row keys)
        recorded = st is not None and (nbad_f > 0 or skip) and st.has("pgrad")
        if st is not None and recorded and nbad_f > 0:  # (no non-finite norm: no non-finite element either)
            bad_params = [n for n, row in st.pgrad.items() if nonfinite(row) > 0]
        elif not recorded and nbad_f > 0:
            idx = s.idx_params if s.idx_params is not None else s.gparams
            bad_params = [self.names[id(idx[int(first_f)])]]
        else:
            bad_params = []
        count = len(bad_params) if recorded else int(nbad_f)
        reason = ""
        if skip:
            reason = ("nonfinite_loss" if s.loss_known and not math.isfinite(loss_f)
                      else self.grad_reason(st if recorded else None, bad_params))
        scale = scale_f if sc is not None else None
        if sc is not None:
            grown = scale_f * sc.get_growth_factor() if tracker_f + 1 >= sc.get_growth_interval() else scale_f
            after_ok: float | None = grown if math.isfinite(grown) else scale_f
            after_skip: float | None = scale_f * sc.get_backoff_factor()
            if self.grad_inv_scale is not None and self._scale_hint != scale_f and st is not None:
                st.pgrad = {}  # the scale changed behind the recipe's back: rows taken with the wrong factor are dropped
            self._scale_hint = after_skip if will_skip else after_ok
        else:
            after_ok = after_skip = None
        rx, exchanged = self.ranks, s.exchanged
        return Measured(loss_f, pre_f, post_f, skip, reason, scale, after_ok, after_skip, lr_out,
                        bad_params, count, st, int(tracker_f) if sc is not None and math.isfinite(tracker_f) else None,
                        s.tripped, rx.decode(exchanged) if rx is not None and exchanged is not None else None,
                        will_skip=will_skip)

    def grad_reason(self, st: StepStats | None, bad_params: list[str]) -> str:
        """'nonfinite_grad:<module>': the first module in backward whose gradient went non-finite."""
        module = locate.locate_backward(st) if st is not None else None
        if module is None and bad_params:
            module = locate.module_of_param(bad_params[0], self.modules)
        return f"nonfinite_grad:{module}" if module else "nonfinite_grad"

    # the update --------------------------------------------------------------------------------
    def apply(self, m: Measured) -> None:
        """Optimizer step (or skip), ``scaler.update()`` on both paths, FP16 weights from the master."""
        sc = self.scaler
        if self.optimizer is None:  # the caller updates the weights by hand
            return
        if sc is not None:
            if not m.skip:
                sc.step(self.optimizer)  # GradScaler's own sync (found_inf.item())
            sc.update()  # on the skip path too: that is what backs the scale off
            stepped = not m.skip
        else:
            stepped = not m.skip or not self.skip_nonfinite
            if stepped:
                self.optimizer.step()
        if self.scheduler is not None:
            with warnings.catch_warnings():  # a skipped first step: the schedule follows the iterations anyway
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer.step")
                self.scheduler.step()
        if self.master is not None and stepped:
            with torch.no_grad():
                torch._foreach_copy_(list[torch.Tensor](self.model_params), list[torch.Tensor](self.master))

    def weights_finite(self) -> bool:
        """Whether every trained weight is finite now (one more host copy; triage only)."""
        ws = self.master if self.master is not None else self.params
        if not ws:
            return True
        return bool(torch.isfinite(torch.stack(torch._foreach_norm([p.detach().float() for p in ws]))).all())


__all__ = ["Measured", "TrainStep"]
