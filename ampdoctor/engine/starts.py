"""Where the triage stages start: the spec's model (FP32, seeded) and its batches, checked to run; or a training
checkpoint's weights, optimizer and scaler state, on the dataloader's batches after the ones the run had taken."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.engine import preflight
from ampdoctor.engine.forward import make_optimizer
from ampdoctor.engine.stages import ProgressFn
from ampdoctor.errors import SpecError, UsageError
from ampdoctor.input import rebuild
from ampdoctor.input.batches import Batches, grouped, unlisted
from ampdoctor.input.checkpoint import read_checkpoint
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.loading import load_batches
from ampdoctor.input.resume import StartState, load_into
from ampdoctor.input.spec import Spec, call_user
from ampdoctor.report import stages as stage_report


def build_model(spec: Spec, cfg: TriageConfig, device: torch.device) -> nn.Module:
    """The spec's model, FP32, on the device (seeded)."""
    torch.manual_seed(cfg.seed)
    model = call_user(spec.build_model, what="build_model()", path=spec.path)
    if not isinstance(model, nn.Module):
        raise SpecError(f"{spec.path.name}: build_model() returned {type(model).__name__}; return a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise SpecError(f"{spec.path.name}: the model has no trainable parameters")
    meta = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if meta:
        raise SpecError(f"{spec.path.name}: build_model() returned a model on the meta device ({meta[0]} has no data"
                        + (f", and {len(meta) - 1} more" if len(meta) > 1 else "") + "); materialise it before returning "
                        "it: model.to_empty(device='cpu') and then load or initialise its weights")
    return model.to(device).float()


def prepare(spec: Spec, cfg: TriageConfig, device: torch.device,
            progress: ProgressFn | None = None) -> tuple[nn.Module, Batches]:
    """Build the model and batches, and check that they run in FP32 with a scalar loss.

    ``progress("batches", n)`` is called as the batches are taken from the dataloader.
    """
    model = build_model(spec, cfg, device)
    preflight.initial_weights(model, spec.path)
    batches = unlisted(load_batches(spec, cfg.steps * cfg.accumulate, progress), cfg.accumulate)
    preflight.optimizer(spec, model)
    preflight.batches_run(spec, model, batches, device)
    return model, grouped(batches, cfg.steps, cfg.accumulate)


def skipping(spec: Spec, n: int) -> tuple[Spec, list[str]]:
    """The spec with a dataloader that starts after its first ``n`` batches (where a resumed run was): past
    the end of an epoch it goes on with the next, as the run did, calling the sampler's ``set_epoch(e)``
    (DistributedSampler, and any sampler that has it) before each; a seeded ``RandomSampler`` draws each
    epoch's order from its generator as the run's did. The list gets a sentence (once the dataloader is
    built) saying how the epochs were re-made and what could not be."""
    build = spec.build_dataloader
    said: list[str] = []

    def build_after() -> Any:
        loader = build()
        epoch, it, i, taken = 0, _epoch_iter(loader, 0), 0, 0
        while taken < n:
            try:
                next(it)
            except StopIteration:
                if i == 0:
                    raise UsageError(f"--skip-batches {n}: build_dataloader() yields no batch"
                                     + (f" in epoch {epoch} (after {taken} in the epochs before); give --skip-batches below "
                                        f"{taken}" if taken else "")) from None
                epoch, i = epoch + 1, 0
                it = _epoch_iter(loader, epoch)
                continue
            taken += 1
            i += 1
        said[:] = [_epoch_words(loader, epoch, i)] if epoch else []
        return _Epochs(loader, it, epoch)

    return replace(spec, build_dataloader=build_after), said


def _epoch_iter(loader: Any, epoch: int) -> Any:
    """``iter(loader)`` for ``epoch``: ``set_epoch(epoch)`` first on whatever has it (the loader, its sampler,
    its batch sampler and that one's sampler), as the run's epoch loop does."""
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        fn = getattr(obj, "set_epoch", None)
        if callable(fn):
            fn(epoch)
    return iter(loader)


def _epoch_words(loader: Any, epoch: int, at: int) -> str:
    """How the skip reached epoch ``epoch`` (batch ``at`` of it), and whether its order is the run's."""
    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    if any(callable(getattr(x, "set_epoch", None)) for x in [loader, *samplers]):
        how = "set_epoch"
    else:
        rnd = next((x for x in samplers if isinstance(x, torch.utils.data.RandomSampler)), None)
        how = "global_rng" if rnd is not None and rnd.generator is None else "in_order"
    return stage_report.epochs(epoch, at, how)


class _Epochs:
    """The rest of the skipped-into epoch, then the next epochs (``set_epoch`` before each)."""

    def __init__(self, loader: Any, it: Any, epoch: int) -> None:
        self.loader, self.it, self.epoch = loader, it, epoch

    def __iter__(self) -> _Epochs:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.it = _epoch_iter(self.loader, self.epoch)
            return next(self.it)


def prepare_checkpoint(spec: Spec, cfg: TriageConfig, device: torch.device, path: str | Path, skip_batches: int,
                       progress: ProgressFn | None, attn_implementation: str | None = None,
                       ) -> tuple[Spec, nn.Module, Batches, StartState, str, list[str]]:
    """The model with a training checkpoint's weights, its optimizer and scaler state, and the dataloader's
    batches after ``skip_batches``; a layout ampdoctor cannot read is one line. A spec without
    ``build_model`` gets the model the checkpoint describes (a Trainer folder's config.json), and one without
    ``build_optimizer`` the optimizer groups its optimizer state was saved with."""
    said: list[str] = []
    if not spec.own_model:
        rb = rebuild.from_checkpoint(path, rebuild.lightning_hparams(path), attn_implementation)
        spec = replace(spec, build_model=rb.build)
        said.append(rb.source)
    model = build_model(spec, cfg, device)
    if spec.loss_fn is None and rebuild.is_lightning(model):  # a LightningModule's loss is its own training_step
        spec = replace(spec, loss_fn=rebuild.TrainingStepLoss())
        said.append(stage_report.source(stage_report.Source("training_step", type(model).__name__)))
    if spec.build_optimizer is None and spec.load_checkpoint is None and rebuild.is_lightning(model):
        spec = replace(spec, build_optimizer=rebuild.lightning_optimizer)
        groups = rebuild.lightning_optimizer(model).param_groups
        said.append(stage_report.source(stage_report.Source("lightning_optimizer", type(model).__name__,
                                                            groups=tuple(len(g["params"]) for g in groups))))
    elif spec.build_optimizer is None and spec.load_checkpoint is None:
        saved = read_checkpoint(path, model=model).optimizer
        if saved is not None:
            build_opt, how = rebuild.optimizer_from_state(model, saved, str(path))
            spec = replace(spec, build_optimizer=build_opt)
            said.append(how)
    else:
        preflight.optimizer(spec, model)  # build_optimizer and build_scheduler: one line if they are broken
    opt = make_optimizer(spec.build_optimizer, model)
    scaler = torch.amp.GradScaler(device.type)
    state = read_checkpoint(path, load_checkpoint=spec.load_checkpoint, model=model, optimizer=opt, scaler=scaler)
    lacks = load_into(state, model, opt, scaler)
    preflight.initial_weights(model, spec.path)
    step0 = state.next_step if state.next_step is not None else skip_batches
    loader_note: list[str] = []
    if skip_batches:
        spec, loader_note = skipping(spec, skip_batches)
    batches = unlisted(load_batches(spec, cfg.steps * cfg.accumulate, progress), cfg.accumulate)
    preflight.batches_run(spec, model, batches, device)
    batches = grouped(batches, cfg.steps, cfg.accumulate)
    opt_state = opt.state_dict() if state.optimizer is not None else None
    scaler_state = dict(scaler.state_dict()) if state.scaler is not None else None
    note = stage_report.checkpoint_start(state.layout, path, state.step, step0, skip_batches,
                                         [*state.notes, *lacks, *loader_note])
    return spec, model, batches, StartState(copy.deepcopy(opt_state), scaler_state, step0, rng=state.rng), note, said
