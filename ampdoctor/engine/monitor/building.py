"""What a Monitor builds once its setup is known to be one it can watch: the hooks, the step recipe (the same one
``ampdoctor triage`` runs), the distributed exchange, a sharding engine's pieces, the capture, the step log and the
lookback ring; what it says once about a sharding engine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ampdoctor.capture.trigger import FailingStep
from ampdoctor.engine.driver import Driver
from ampdoctor.engine.monitor import capturing, exchange, fp8, lookback, skips
from ampdoctor.engine.monitor.injection import Injection
from ampdoctor.engine.monitor.records import CAPTURE_COLUMNS, EXTRA_COLUMNS, RANK_COLUMNS, SHARDED, STEP_COLUMNS, _Unreadable
from ampdoctor.engine.monitor.sentinel import Sentinel
from ampdoctor.engine.step import TrainStep
from ampdoctor.formats import BF16, FP16
from ampdoctor.ladder import Rung
from ampdoctor.notify import alert, say
from ampdoctor.parallel.exchange import rank_path
from ampdoctor.parallel.pieces import Shards
from ampdoctor.parallel.registry import named
from ampdoctor.report import alerts as words
from ampdoctor.watch.fused import start_build
from ampdoctor.watch.hooks import Hooks
from ampdoctor.watch.steplog import StepLogWriter

if TYPE_CHECKING:
    from ampdoctor.engine.monitor.monitor import Monitor


def build(mon: Monitor, scaler: torch.amp.GradScaler | None) -> None:
    """Everything built once the setup is known to be one the monitor can watch."""
    cfg = mon.config
    mon.keep_stats = cfg.keep_stats
    mon.capture_ranks = cfg.capture_ranks
    mon._batch_checked = False
    mon._last_stats = None
    mon._asked = False
    first = next(iter(mon.model.parameters()), None)
    mon.device = first.device if first is not None else torch.device("cpu")
    mon.amp_dtype = cfg.amp_dtype if cfg.amp_dtype is not None or mon.scaler is None else torch.float16
    mon.injection = Injection(cfg, mon.model)
    build_recipe(mon)
    mon.ranks = mon.recipe.ranks = exchange.detect(mon, cfg)
    mon.rank = mon.ranks.rank if mon.ranks is not None else None
    if mon.engine in SHARDED:
        build_shards(mon)
    log_file = rank_path(str(cfg.log), mon.rank) if mon.rank is not None and cfg.log else cfg.log
    folder = cfg.capture
    if mon.rank is not None and folder is not None:
        folder = rank_path(str(folder), mon.rank)
    if folder is not None:
        mon.capture = capturing.arm(mon, cfg, folder)
    mon._failing = FailingStep(mon.scaler.get_growth_interval() if mon.scaler is not None else 2000,
                               every_skip=cfg.capture_on == "skip")
    mon._episodes = skips.Episodes()
    build_log(mon, log_file)
    if mon.engine in SHARDED and mon.rank in (None, 0):
        say_sharded(mon, scaler)
    mon.lookback = lookback.build(mon, cfg)
    mon.fp8 = fp8.attach(mon)  # a torchao-converted model's per-GEMM statistics (engine/monitor/fp8.py)
    mon.hooks.on_error = mon._hook_failed
    mon.hooks.attach()
    mon.hooks.begin_step(mon.step_num)
    start_build()  # the one-pass statistics kernel, built by another process if not cached (watch.fused)
    mon.sentinel.warm_start(mon.device, mon.recipe.shards is not None and mon.ranks is not None)


def build_recipe(mon: Monitor) -> None:
    """The hooks, the step recipe (the same one ``ampdoctor triage`` runs) and the sentinel's schedule."""
    cfg, amp = mon.config, mon.amp_dtype
    mon.hooks = Hooks(mon.model, BF16 if amp == torch.bfloat16 else FP16, activations=cfg.activations,
                      params=cfg.weights, every=cfg.every)
    mon.recipe = TrainStep(mon.model, mon.optimizer, mon.scaler, hooks=mon.hooks, max_norm=cfg.max_norm,
                           precision=Rung.for_autocast(amp, mon.scaler is not None),
                           sentinel=mon.hooks.fmt.max if cfg.mode == "sentinel" else None)
    mon.driver = Driver(mon.recipe)
    mon._params = mon.recipe.params
    mon._names = mon.recipe.names
    mon.sentinel = Sentinel(cfg, mon.hooks, mon.recipe)


def build_shards(mon: Monitor) -> None:
    """A sharding engine's pieces (``parallel.pieces``): norms and rows reduced across the ranks."""
    assert mon.engine is not None
    rx = mon.ranks
    rank, world = (rx.rank, rx.world) if rx is not None else exchange.dist_rank()
    mon.recipe.shards = sh = Shards(mon.engine, mon.model, mon._params, rank, world)
    eng = named(mon.engine)
    if rx is not None and eng is not None:  # (the engine's own facts: parallel.protocol.Engine)
        rx.by_position = eng.shares_batch  # ranks share a batch (tensor parallelism): order by the forward
        rx.derived_inputs = eng.casts_inputs  # (FSDP's mixed precision casts the batch)
        rx.groups = sh.reader.groups  # (a 2-D mesh: which ranks run one batch, parallel.protocol.Reader.groups)
    if sh.problem is not None:
        raise _Unreadable(f"{SHARDED[mon.engine]} over {sh.problem} is not supported yet")


def build_log(mon: Monitor, log_file: str | Path | None) -> None:
    """The step-log writer; a wrong log path fails now, not after the first step (rows already there: judged at
    the first write, as a load_state_dict may yet continue the run)."""
    cfg = mon.config
    mon.log_path = Path(log_file) if log_file else None
    if not log_file:
        return
    extra = (EXTRA_COLUMNS + (CAPTURE_COLUMNS if mon.capture is not None else ())
             + (RANK_COLUMNS if mon.rank is not None else ()) + (STEP_COLUMNS if cfg.step_convention is not None else ()))
    fresh = cfg.fresh_step
    mon.writer = StepLogWriter(log_file, extra_columns=extra, mode=cfg.log_mode, fsync=cfg.fsync, fresh_step=fresh)
    mon.writer.check(cfg.first_step if cfg.first_step > fresh else None)


def say_sharded(mon: Monitor, scaler: Any) -> None:
    """Under a sharding engine, once (rank 0): what the log's norms are, and a scaler that lets the ranks drift."""
    name = SHARDED[mon.engine or ""]
    if not mon.recipe.reduced:
        say(words.sharded_no_exchange(name), quiet=mon.quiet)
    if (mon.engine == "fsdp1" and mon.scaler is not None and type(scaler).__name__ != "ShardedGradScaler"
            and mon.recipe.ranks is not None):  # (DTensor gradients: GradScaler's found-inf is all-reduced already)
        alert(words.sharded_plain_scaler(name), RuntimeWarning, quiet=mon.quiet)
