"""``triage SPEC --from CAP --nproc N``: the per-rank captures of one sharded step replayed on N processes
under the layout the run used.

The parent checks first (one line, exit 2, before any process starts): the capture is a sharded one, ``N``
is its ``world_size``, its manifest records how the model was sharded (``shards.recipe``, the engine's
``parallel.protocol.Engine.recipe``: FSDP2's ``fully_shard`` modules, ``MixedPrecisionPolicy`` and mesh,
``parallel.fsdp2``; a tensor-parallel plan, ``parallel.tp``; FSDP1's wrapping, ``parallel.fsdp1``; DeepSpeed's
engine is not recorded) and the engine is installed. It then starts N processes over gloo on the CPU
(``torch.multiprocessing``, spawn). Each rank builds the recorded mesh and the spec's model, lays it out as
recorded (the engine's ``rebuild``: ``fully_shard``, ``parallelize_module`` / ``distribute_tensor``, or
``FullyShardedDataParallel``), checks
that the piece it holds of every tensor sits where its capture says (the same layout), loads its own
capture's pieces of the weights and optimizer state (as DTensors) and runs the captured batches twice: FP32
(no mixed-precision policy, no scaler) and the run's precision (its policy, a ``ShardedGradScaler`` from the
captured state; under tensor parallelism the run's ``GradScaler``), with a ``Monitor`` whose exchange names the
first rank, kind and module across the ranks (under tensor parallelism by forward position: the rank whose own
computation went bad first, not one a collective carried the NaN to).

Nothing runs a collective that only one rank joins: every rank joins one agreement after setting up (a rank
that failed says so there and every rank stops), and a rank that fails later exits non-zero, which ends the
others (``ProcessContext.join``); a replay that does not finish in ``TIMEOUT_S`` is ended too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.capture.folder import read_rank
from ampdoctor.capture.rank_folders import rank_captures
from ampdoctor.capture.read import layout_optimizer
from ampdoctor.capture.reassemble import check_pieces
from ampdoctor.capture.schema import MANIFEST, read_manifest
from ampdoctor.errors import CaptureError, UsageError
from ampdoctor.parallel.protocol import Engine
from ampdoctor.parallel.registry import named

STOPPED = "stopped: another rank could not set up its replay"
TIMEOUT_S = 600.0
"""The longest a replay on N ranks may take (spawning N Python processes included)."""


@dataclass
class RankReplay:
    """What the N ranks' replay found, per stage: rank 0's log of each step and the first fault (the exchange's,
    the same on every rank)."""

    nproc: int
    layout: str
    """The layout in words: the engine, its mesh, the modules sharded, the mixed-precision policy."""
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)

    def first(self, stage: str) -> list[Any] | None:
        """(step, rank, kind, module) of the stage's first non-finite value on any rank, or None."""
        ff = self.stages.get(stage, {}).get("first_fault")
        return list(ff[:4]) if ff else None

    def words(self, rules_at: tuple[Any, Any] | None = None) -> str:
        from ampdoctor.report.stages import ranks_replayed

        return ranks_replayed(self.nproc, self.layout, [(st, self.first(st)) for st in self.stages], rules_at)

    def apply(self, report: Any) -> None:
        """Say in the report that the replay ran on N ranks (in place of the one-process reassembly), and keep its
        facts in ``config["replayed_on"]``."""
        notes = [n for n in report.notes if "on one process" not in n]
        v = report.verdict
        ff = next((self.first(s) for s in self.stages if self.first(s)), None)
        agree = ff is None or v.first_step is None or (ff[0] == v.first_step and (v.first_module in (None, ff[3])))
        notes.insert(0, self.words(None if agree else (v.first_step, v.first_module)))
        report.notes = notes
        report.config["replayed_on"] = {"nproc": self.nproc, "layout": self.layout, "stages": self.stages}


# the checks, before any process starts ----------------------------------------------------------------
def _manifest(cap: Path) -> tuple[dict[str, Any], dict[int, Path]]:
    group = rank_captures(cap)
    first = group.get(0) or next(iter(group.values()), None)
    if first is None:
        if not (cap / "manifest.json").is_file():
            raise CaptureError(f"{cap}: no such capture folder; pass the folder Monitor(capture=...) wrote")
        return read_manifest(cap / "manifest.json"), {}
    return read_manifest(first / "manifest.json"), group


def check(capture: str | Path, nproc: int) -> tuple[dict[str, Any], dict[int, Path]]:
    """The manifest of rank 0's capture and every rank's folder, when the capture can be replayed on ``nproc``
    ranks; else ``UsageError`` (one line: what to give instead)."""
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: give the number of ranks the run had (2 or more), or drop --nproc")
    cap = Path(capture)
    m, group = _manifest(cap)
    engine, world = m.get("sharded"), int(m.get("world_size") or 1)
    if not engine:
        raise UsageError(f"--nproc {nproc}: {cap} holds one process's whole model (world_size {world}), not per-rank "
                         "shards; drop --nproc")
    if nproc != world:
        raise UsageError(f"--nproc {nproc}: {cap} holds the shards of {world} ranks (world_size {world}); give "
                         f"--nproc {world}, or drop --nproc to reassemble them on one process")
    if engine == "deepspeed" and not _installed("deepspeed"):
        raise UsageError(f"--nproc {nproc}: {cap} is a DeepSpeed capture and DeepSpeed is not installed here; drop "
                         "--nproc to reassemble it on one process (no DeepSpeed needed)")
    rec = (m.get("shards") or {}).get("recipe")
    if not isinstance(rec, dict) or named(str(rec.get("engine"))) is None:
        raise UsageError(f"--nproc {nproc}: {cap}'s manifest records no sharding recipe for its {engine} layout (only "
                         "FSDP2's fully_shard, FSDP1's wrapping and a tensor-parallel plan are recorded); drop --nproc to "
                         "reassemble it on one process")
    _rebuildable(cap, nproc, rec)
    if int(torch.Size(rec.get("mesh") or [0]).numel()) != world:
        raise UsageError(f"--nproc {nproc}: {cap} was sharded on a mesh of shape {rec.get('mesh')}, not one of {world} "
                         "ranks; drop --nproc")
    if sorted(group) != list(range(world)):
        missing = sorted(set(range(world)) - set(group))
        raise CaptureError(f"{cap}: rank(s) {', '.join(map(str, missing))} of {world} have no capture beside it (copy "
                           "every <name>.rank<N> folder of the step together)")
    check_pieces(cap, group)  # one run, every piece where its manifest says: one line now, not a rank's later
    return m, group


def _rebuildable(cap: Path, nproc: int, rec: dict[str, Any]) -> None:
    """UsageError (one line) when this torch, or this replay, cannot rebuild the recorded layout."""
    eng = _engine(rec)
    need = eng.replay_requires or "torch.distributed"
    if not (torch.distributed.is_available() and _installed(need)):
        raise UsageError(f"--nproc {nproc}: this torch has no {need} to rebuild the {rec['engine']} layout with; drop "
                         "--nproc to reassemble the capture on one process")
    why = eng.refusal(rec)
    if why:
        raise UsageError(f"--nproc {nproc}: {cap} cannot be replayed under its layout: {why}; drop --nproc to "
                         "reassemble it on one process")


def _engine(rec: dict[str, Any]) -> Engine:
    """The engine a recipe names (``check`` made sure one does)."""
    eng = named(str(rec.get("engine")))
    if eng is None:
        raise CaptureError(f"the capture's layout names the engine {rec.get('engine')!r}, which this ampdoctor does not know")
    return eng


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def layout_words(rec: dict[str, Any]) -> str:
    from ampdoctor.report.stages import layout

    return layout(rec)


# the replay -------------------------------------------------------------------------------------------
def replay_ranks(spec_path: str | Path | None, capture: str | Path, nproc: int, names: Any = None,
                 timeout_s: float = TIMEOUT_S) -> RankReplay:
    """Check, then replay the capture on ``nproc`` ranks (see the module); raises ``UsageError`` / ``CaptureError``
    with one line."""
    m, group = check(capture, nproc)
    if spec_path is None:
        raise UsageError("--nproc: give the spec (SPEC.py with build_model()) the ranks rebuild the model from")
    from dataclasses import astuple

    import torch.multiprocessing as mp

    ctx = None
    out = Path(tempfile.mkdtemp(prefix="ampdoctor-ranks-"))
    try:  # the ranks' results folder goes on every way out: an error, a rank's failure, Ctrl-C
        args = (nproc, _free_port(), str(spec_path), astuple(names) if names is not None else None,
                [str(group[r]) for r in range(nproc)], str(out))
        ctx = mp.start_processes(_worker, args=args, nprocs=nproc, join=False, start_method="spawn")
        failed = _wait(ctx, timeout_s)
        results = {r: json.loads(f.read_text()) for r in range(nproc) if (f := out / f"rank{r}.json").is_file()}
    finally:
        if ctx is not None:
            _end(ctx.processes)
        shutil.rmtree(out, ignore_errors=True)
    errors = [f"rank {r}: {res['error']}" for r, res in sorted(results.items()) if res.get("error")]
    own = [e for e in errors if STOPPED not in e]
    errors = own or errors  # the rank that failed, not the ones it stopped
    if errors or failed or len(results) != nproc:
        raise CaptureError(f"{capture}: the replay on {nproc} ranks failed ({'; '.join(errors) or failed or 'a rank wrote nothing'})")
    return RankReplay(nproc, layout_words(m["shards"]["recipe"]), results[0]["stages"])


def _wait(ctx: Any, timeout_s: float) -> str:
    """Join the ranks; what went wrong in words ("" when every rank exited cleanly)."""
    end = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > end:
                _end(ctx.processes)
                return f"did not finish in {timeout_s:.0f} s"
    except Exception as e:  # a rank exited non-zero: join ended the others
        return str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    return ""


def _end(processes: list[Any]) -> None:
    """Stop the ranks still running (a timeout, Ctrl-C in the parent), and wait for them to go."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, spec_path: str, names: tuple[str, ...] | None, folders: list[str],
            out: str) -> None:
    """One rank (a spawned process): set up, agree with the others, replay, write ``OUT/rank<r>.json``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # (DTensor's note on a one-element scale or loss is about the replay's own tensors, not the user's code)
    warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
    # (DTensor's note that a 2-D mesh's found-inf takes two all-reduces is about the replay's own scaler, not the run)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res: dict[str, Any] = {}
    try:
        try:  # every rank, first: the mesh (its process groups are collectives)
            rec = read_manifest(Path(folders[rank]) / MANIFEST)["shards"]["recipe"]  # (check: every rank's is the run's)
            mesh = _engine(rec).device_mesh(rec)
        except Exception as e:
            res["error"] = _line(e)
            Path(out, f"rank{rank}.json").write_text(json.dumps(res))
            return
        try:  # no collective in here: a rank that fails says so at the agreement below
            job = _Rank(rank, spec_path, names, Path(folders[rank]), mesh)
            job.model(job.stages[0])  # the layout rebuilt and checked against this rank's capture
        except Exception as e:
            job, res["error"] = None, _line(e)
        bad = torch.tensor([0.0 if job is not None else 1.0])
        dist.all_reduce(bad)  # every rank, once: nobody replays unless every rank is set up
        if job is not None and float(bad) == 0.0:
            try:
                res["stages"] = {st: job.run(st) for st in job.stages}
            except Exception as e:
                res["error"] = _line(e)
                Path(out, f"rank{rank}.json").write_text(json.dumps(res))
                os._exit(3)  # the others may wait in a collective: the parent's join ends them
        elif job is not None:
            res["error"] = STOPPED
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
        dist.barrier()  # every rank here: none tears gloo down while another still talks (an abort at exit)
    finally:
        dist.destroy_process_group()
    # This rank's file is written. Skip the interpreter's teardown: gloo's threads outlive destroy_process_group
    # while the mesh and the replayed model hold the group, and tearing them down with the interpreter now and
    # then aborts the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


class _Rank:
    """One rank's replay: its capture, the spec, and the recorded recipe."""

    def __init__(self, rank: int, spec_path: str, names: tuple[str, ...] | None, folder: Path, mesh: Any) -> None:
        from ampdoctor.input.spec import SpecNames, importable, load_spec

        self.rank = rank
        self.mesh = mesh
        with importable(Path(spec_path)):
            self.spec = load_spec(spec_path, SpecNames(*names) if names else None, require_data=False)
        self.cap = read_rank(folder)
        sh = self.cap.manifest["shards"]
        self.layout: dict[str, Any] = sh["model"]
        self.opt_names: list[str | None] = sh.get("optimizer_params") or []
        self.recipe: dict[str, Any] = sh["recipe"]
        self.engine = _engine(self.recipe)
        self.build_optimizer = self.spec.build_optimizer or layout_optimizer(self.cap.manifest.get("optimizer_layout"))
        ad = self.cap.manifest.get("autocast_dtype")
        self.autocast = getattr(torch, str(ad)) if ad in ("float16", "bfloat16") else None
        self.stages = ["fp32", self.cap.precision]

    def model(self, stage: str) -> nn.Module:
        """The spec's model sharded as the run's was (FP32: without the mixed-precision policy), holding this
        rank's captured pieces; raises CaptureError when a piece sits elsewhere than the capture says."""
        from ampdoctor.watch.model_view import local, unwrap, user_name

        torch.manual_seed(0)
        model = self.spec.build_model()
        if [int(x) for x in self.mesh.shape] != list(self.recipe["mesh"]):
            raise CaptureError(f"the run's mesh was {self.recipe['mesh']}; this replay's is {list(self.mesh.shape)}")
        model = self.engine.rebuild(model, self.recipe, self.mesh, stage != "fp32")
        piece = self.engine.read(unwrap(model), [], self.rank, int(self.mesh.size())).piece
        with torch.no_grad():
            for n, t in [*model.named_parameters(), *model.named_buffers()]:
                un = user_name(n)
                want, have = self.layout.get(un), piece(t)
                if want != have:
                    raise CaptureError(f"{un}: rebuilt, rank {self.rank}'s piece is {have}; its capture's is {want} "
                                       "(not the layout the run had)")
                got = self.cap.model.get(un)
                if got is None or tuple(got.shape) != tuple(local(t).shape):
                    what = "no piece" if got is None else f"a piece of shape {list(got.shape)}"
                    raise CaptureError(f"{un}: {self.cap.path.name}'s state holds {what}; field shards.model[{un!r}] "
                                       f"{want} puts one of shape {list(local(t).shape)} on rank {self.rank}")
                local(t).copy_(got)
        return model

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        from torch.distributed.tensor import DTensor

        from ampdoctor.engine.forward import make_optimizer
        from ampdoctor.watch.model_view import local, user_name

        opt = make_optimizer(self.build_optimizer, model)
        st = self.cap.start.optimizer
        if st is None:
            return opt
        by_name = {user_name(n): p for n, p in model.named_parameters()}
        state: dict[int, dict[str, Any]] = {}
        for i, entry in st["state"].items():
            name = self.opt_names[int(i)] if int(i) < len(self.opt_names) else None
            p = by_name.get(name) if name is not None else None
            if p is None:
                raise CaptureError(f"optimizer state entry {i} names no parameter of the spec's model")
            state[int(i)] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,  # type: ignore[attr-defined]
                                                   stride=p.stride())
                             if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0
                             and v.shape == local(p).shape else v
                             for k, v in entry.items()}
        opt.load_state_dict({"state": state, "param_groups": st["param_groups"]})
        return opt

    def run(self, stage: str) -> dict[str, Any]:
        """The captured batches through this stage on every rank: each step's loss, global norm and skip, and the
        exchange's first fault."""
        from ampdoctor.engine.forward import batch_loss
        from ampdoctor.engine.monitor import Monitor
        from ampdoctor.input.batches import micro_batches, to_device

        model = self.model(stage)
        opt = self.optimizer(model)
        low = stage != "fp32"
        scaler = None
        if low and self.cap.start.scaler is not None:  # tensor parallelism: the ranks' gradients agree, a GradScaler
            scaler = self.engine.grad_scaler()("cpu")
            scaler.load_state_dict(dict(self.cap.start.scaler))
        amp = self.autocast if low else None
        mon = Monitor(model, opt, scaler, log=None, quiet=True, first_step=self.cap.start.step0, alert_min_steps=10**6,
                      amp_dtype=amp if scaler is None else None)
        steps = []
        try:
            for b in self.cap.batches:
                micro = micro_batches(b)
                total = None
                for mb in micro:
                    with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
                        _, loss = batch_loss(model, to_device(mb, torch.device("cpu")), self.spec.loss_fn)
                    loss = loss / len(micro) if len(micro) > 1 else loss
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    total = loss.detach() if total is None else total + loss.detach()
                mon.after_backward(total)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                elif not mon.should_skip:
                    opt.step()
                rec = mon.after_step()
                opt.zero_grad(set_to_none=True)
                if rec is not None:
                    steps.append({"step": rec.step, "loss": rec.loss, "grad_l2": rec.grad_l2_pre_clip, "skipped": rec.skipped})
        finally:
            mon.close()
        ff = mon.first_fault
        return {"steps": steps, "off": mon.off,
                "first_fault": None if ff is None else [ff.step, ff.rank, ff.kind, ff.module, ff.others_clean]}


__all__ = ["RankReplay", "check", "replay_ranks"]
