"""Capture the first failing step of a real run, so ``ampdoctor triage --from`` can replay it.

``Monitor(..., capture="ampdoctor-capture")`` arms a ``Capture``. Every ``snapshot_every`` steps it
keeps a host copy of the model, optimizer and GradScaler state, and from then on a host copy of
every batch (``monitor.step(loss, batch=batch)``). On the first failing step after GradScaler's
calibration it writes one folder and training carries on:

======================  =====================================================================
``manifest.json``       schema version, step, reason, module, lr, scale, growth tracker, loss,
                        gradient norm, autocast dtype, device, versions, Monitor settings,
                        rank and world size, what each file holds, what was left out
``state.pt``            model / optimizer / scaler state **before** the failing step (written
                        when the step was skipped: then the live state is exactly that)
``snapshot.pt``         the last periodic host copy (step ``snapshot_step``), to re-reach the
                        failing step by replay when an applied update broke the weights
``batches.pt``          the batches since the snapshot, the failing one last (``batch_steps``)
``rng.pt``              torch, CUDA, numpy and python RNG states
``stats.json``          the last per-layer statistics the Monitor computed
``ring_steps.csv``      the lookback ring (``watch.ring``): the last K steps' loss, norm, scale, skip, lr
``ring_layers.csv``     and per layer and recorded step: headroom, shares, gradient and update norms
======================  =====================================================================

Every ``.pt`` file loads with ``torch.load(weights_only=True)``. The folder is written under a
temporary name and renamed; an existing capture is never overwritten (``name-1``, ``name-2``...).

A **failing step** is one GradScaler's own working does not explain (``FailingStep``): a non-finite
loss; a skip the scale does not explain (the growth it needs since the last applied step is a jump, or
it came at a scale <= 1: the unscaled gradients leave FP16), captured from the first skip since the
last applied step; without a GradScaler, any non-finite gradient; the skip-rate alert (calibration not
counted; provisional: a later failure is captured beside it). A capture failure is a warning
(``CaptureWarning``), never an exception in the training loop.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import math
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor._version import __version__
from ampdoctor.capture import reference as capture_ref
from ampdoctor.capture.identity import run_id
from ampdoctor.capture.schema import (
    BATCHES_FILE,
    CAPTURE_VERSION,
    MANIFEST,
    MICRO_KEY,
    RNG_FILE,
    SNAPSHOT_FILE,
    STATE_FILE,
    STATS_FILE,
    validate_batches,
    validate_manifest,
    validate_state,
)
from ampdoctor.capture.state import (
    engine_recipe,
    host_copy,
    local_state,
    model_fingerprint,
    model_identity,
    nbytes,
    optimizer_layout,
    optimizer_names,
    process_rank,
    raw_rng,
    rng_states,
    spec_hint,
    stats_json,
)
from ampdoctor.capture.trigger import FailingStep, Trigger
from ampdoctor.input import origin
from ampdoctor.input.batches import Micro
from ampdoctor.notify import say, warn_user
from ampdoctor.records import StepStats
from ampdoctor.watch import userhooks

log = logging.getLogger("ampdoctor")


DEFAULT_MAX_BYTES = 4 << 30


class CaptureWarning(UserWarning):
    """Writing a capture failed; training goes on."""


def default_hold_bytes(max_bytes: int) -> int:
    """The capture's default host budget: a thirty-second of the machine's RAM, never more than ``max_bytes``."""
    try:
        ram = int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):  # not POSIX: the cap alone
        return max_bytes
    return max(1, min(max_bytes, ram // 32))


def free_path(path: Path) -> Path:
    """``path`` if nothing is there, else ``path-1``, ``path-2``...: a capture never overwrites one."""
    if not path.exists():
        return path
    i = 1
    while Path(f"{path}-{i}").exists():
        i += 1
    return Path(f"{path}-{i}")


@dataclass
class Capture:
    """Keeps what a capture needs and writes it once, on the first failing step."""

    path: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scaler: torch.amp.GradScaler | None
    snapshot_every: int = 100
    max_bytes: int = DEFAULT_MAX_BYTES
    settings: dict[str, Any] = field(default_factory=dict)
    autocast_dtype: str | None = None
    written: Path | None = None
    """The capture folder, once written."""
    _snapshot: dict[str, Any] | None = None
    _snapshot_step: int | None = None
    _batches: list[Any] = field(default_factory=list)
    _batch_steps: list[int] = field(default_factory=list)
    _rule: FailingStep = field(default_factory=FailingStep)
    done: bool = False
    quiet: bool = False
    """``Monitor(quiet=True)``: nothing on the default stderr handler (see ``ampdoctor.notify``)."""
    sharded: str | None = None
    """The sharding engine of the model (``parallel.registry.sharded_engine``): the capture then holds this rank's shard."""
    layout: dict[str, Any] | None = None
    """Under a sharding engine: where each tensor of this rank's state sits in the whole one
    (``parallel.pieces.Shards.layout``), written to the manifest so the ranks' captures are reassembled."""
    hold_bytes: int = 0
    """What the capture may hold on the host between snapshots (the snapshot and the batches since): 0 means
    ``default_hold_bytes(max_bytes)``. Past it a snapshot is taken early, so the held batches restart."""
    held: int = 0
    """Bytes held now: the last snapshot and the batches since (the step log's ``capture_held_bytes``)."""
    early_snapshots: int = 0
    """Snapshots taken before ``snapshot_every`` because the batches filled ``hold_bytes``."""
    _snap_bytes: int = 0
    _batch_bytes: int = 0
    _run: tuple[int, Any, dict[str, Any] | None] | None = None
    """The first skipped step since the last applied one: (step, the RNG as it began, the scaler's state before it)."""
    earlier: tuple[Path, int, str] | None = None
    """A provisional capture written before (``Trigger.provisional``): (its folder, step, reason); the capture stays
    armed for a failure, written beside it as ``<path>-2-<reason>``."""

    def __post_init__(self) -> None:
        if self.hold_bytes <= 0:
            self.hold_bytes = default_hold_bytes(self.max_bytes)
        self.run_id = run_id()  # at arming, every rank alive: the id the ranks' captures share
        self._rng: tuple[Any, ...] | None = None
        self._rng_step: int | None = None
        self._rng_forward: int | None = None

    def step_starts(self, step: int, forward: bool = False) -> None:
        """The RNG states as ``step`` begins, so a replay of that step draws what the run drew (dropout, a
        timestep or noise drawn in the step). Kept at the end of the previous step, then again as the step's
        first training forward of the model begins (``forward=True``: after any draw the loop makes for its
        data, which the replay does not make)."""
        if self.done or (forward and self._rng_forward == step):
            return
        self._rng = raw_rng()
        self._rng_step = step
        self._rng_forward = step if forward else None

    def skip_run_starts(self, step: int, scaler_before: dict[str, Any] | None) -> None:
        """``step`` is the first skip since the last applied step: keep what a replay from it needs (the RNG as it
        began and the scaler's state before it); the weights and optimizer state stay as they are while it skips."""
        if not self.done:
            self._run = (step, self._rng if self._rng_step == step else None, scaler_before)

    # every step ----------------------------------------------------------------------------------
    def before_update(self, step: int, batch: Any) -> None:
        """At the step's one host copy, before the optimizer step: the periodic snapshot, then the batch.

        Bounded: when the snapshot and the batches since would pass ``hold_bytes``, a snapshot is taken
        now (the state before this step's update) and the held batches start again from this one, so the
        failing step can always be re-reached from what is held. A batch that does not fit beside the
        snapshot even alone is still kept (the failing step needs it), alone."""
        if self.done:
            return
        kept = None
        if batch is not None:
            # an accumulated step's micro-batches keep their grouping (the replay runs them as one step)
            kept = {MICRO_KEY: [host_copy(b) for b in batch]} if isinstance(batch, Micro) else host_copy(batch)
        kb = nbytes(kept) if kept is not None else 0
        periodic = self._snapshot is None or step % self.snapshot_every == 0
        full = bool(self._batches) and self._snap_bytes + self._batch_bytes + kb > self.hold_bytes
        if full and not periodic and self._snap_bytes + kb > self.hold_bytes:
            # the snapshot and this batch alone pass the budget: an early snapshot cannot help (and would copy the
            # state every step). Hold this batch alone; the snapshot no longer re-reaches it (a skipped failing
            # step still replays from state.pt), and the next periodic one starts again
            self._batches.clear()
            self._batch_steps.clear()
            self._batch_bytes = 0
            full = False
        if periodic or full:
            self._batches.clear()  # (before the copy: what they held is free for it)
            self._batch_steps.clear()
            self._batch_bytes = 0
            self._snapshot = self.state()
            self._snap_bytes = nbytes(self._snapshot)
            self._snapshot_step = step
            self.early_snapshots += int(full and not periodic)
        if kept is not None:
            self._batches.append(kept)
            self._batch_steps.append(step)
            self._batch_bytes += kb
        self.held = self._snap_bytes + self._batch_bytes

    def state(self) -> dict[str, Any]:
        """Host copies of the model, optimizer and scaler state, as they are now."""
        return {
            "model": host_copy(local_state(self.model)),  # no collective (a sharded model: this rank's shard)
            "optimizer": host_copy(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "scaler": dict(self.scaler.state_dict()) if self.scaler is not None else None,
        }

    def judge(self, *, skipped: bool, reason: str, scale: float | None, alert: bool, nonfinite: bool = False,
              step: int = 0) -> Trigger | None:
        """Whether this step is the failing one (see ``FailingStep``); updates the scale history."""
        if self.done:
            return None
        return self._rule.judge(skipped=skipped, reason=reason, scale=scale, alert=alert, nonfinite=nonfinite, step=step)

    # the capture ---------------------------------------------------------------------------------
    def write(self, trig: Trigger, *, step: int, skipped: bool, record: dict[str, Any], stats: StepStats | None,
              scaler_before: dict[str, Any] | None, extra: dict[str, Any] | None = None, announce: bool = True,
              tables: dict[str, str] | None = None) -> Path | None:
        """Write the capture folder; a failure warns and returns None (training goes on). ``announce``: say
        where it went and how to replay it (else the caller does, with ``replay_hint``). A provisional trigger's
        capture leaves the capture armed for one failure more (``earlier``)."""
        if self.done or (trig.provisional and self.earlier is not None):
            return None
        self.done = not trig.provisional or self.earlier is not None
        if self.earlier is not None:  # the failure after a provisional capture: beside it, within what is left
            self.path = self.earlier[0].parent / f"{self.earlier[0].name}-2-{trig.reason}"
            self.max_bytes = max(0, self.max_bytes - _folder_bytes(self.earlier[0]))
        try:
            self.written = self._write(trig, step=step, skipped=skipped, record=record, stats=stats, scaler_before=scaler_before,
                                       extra=extra or {}, tables=tables or {})
        except Exception as e:  # never break the user's loop
            msg = (f"ampdoctor: could not write the capture of step {step} to {self.path} "
                   f"({type(e).__name__}: {str(e)[:200]}); training goes on")
            say(msg, quiet=self.quiet, warned=True)
            if not self.quiet:
                warn_user(msg, CaptureWarning)
            return None
        if trig.provisional and self.earlier is None and not self.done:
            self.earlier = (self.written, step, trig.reason)
        if announce:
            say("ampdoctor: step %d failed (%s); %s", step, trig.reason, self.replay_hint(), quiet=self.quiet)
        return self.written

    def holds_failure(self) -> str:
        """After a provisional capture, the line that says which capture holds the failure; else ''."""
        e = self.earlier
        if e is None or self.written is None or self.written == e[0]:
            return ""
        return f"{self.written} holds the failure ({e[0]} holds the earlier {e[2]} of step {e[1]})"

    def replay_hint(self) -> str:
        """'captured to DIR; replay it: ampdoctor triage SPEC --from DIR' (the script itself when it is a spec)."""
        where = self.written
        spec = spec_hint()
        needs = [] if spec else _replay_needs(where)  # what this capture's replay needs from a spec (issue 45)
        cmd = f"ampdoctor triage {spec or ('SPEC.py' if needs else '')} --from {where}".replace("  ", " ")
        tail = f"   (SPEC.py: {' and '.join(needs)}; docs/spec-format.md)" if needs else ""
        if self.sharded:
            return (f"captured to {where}: this rank's shard of the {self.sharded} model, beside every other rank's\n"
                    f"  replay it (the shards reassembled on one process): {cmd}{tail}")
        return f"captured to {where}\n  replay it: {cmd}{tail}"

    def _shards(self) -> dict[str, Any]:
        """The manifest's ``shards`` (``capture.reassemble`` describes it): where this rank's pieces sit, the
        optimizer state's parameter names, and how the engine sharded the model."""
        return {"model": self.layout, "optimizer_params": optimizer_names(self.optimizer, self.model), "recipe": engine_recipe(self.model)}

    def _write(self, trig: Trigger, *, step: int, skipped: bool, record: dict[str, Any], stats: StepStats | None,
               scaler_before: dict[str, Any] | None, extra: dict[str, Any], tables: dict[str, str]) -> Path:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking host copies are complete
        left_out: list[str] = []
        files, snap, at_start, batch_steps = self._files(step, skipped, scaler_before, left_out, trig.first)
        reference = capture_ref.written(self, files, snap, batch_steps, self.path)  # the run's checkpoint holds the state
        begins = batch_steps[0] if trig.first is not None and snap is not None and batch_steps[:1] == [trig.first] else step
        manifest = {
            **self._manifest(trig, step, skipped, record, scaler_before),
            **extra,
            "optimizer_layout": optimizer_layout(self.optimizer, self.model),
            "model_identity": model_identity(self.model),
            # the user's gradient / tensor hooks on the model, by name (a replay keeps them if the spec's model has them)
            "user_hooks": [h.as_json() for h in userhooks.found(self.model)],
            # rng.pt: as the failing step began (after the step before it), or else now, after its own draws
            "rng_after_step": begins - 1 if at_start else step,
            "state_step": step if STATE_FILE in files else None,
            "snapshot_step": (begins if begins < step else self._snapshot_step) if snap is not None else None,
            "first_skip": trig.first if begins < step else None,
            "batch_steps": batch_steps,
            "files": sorted([*files, MANIFEST, *([STATS_FILE] if stats is not None else []), *tables]),
            "left_out": left_out,
            **reference,
        }
        # what is written is what a reader accepts (capture.schema): a capture that would not replay is a
        # warning now, not a surprise for the person it is mailed to
        text = json.dumps(manifest, indent=2) + "\n"
        validate_manifest(json.loads(text), self.path / MANIFEST)
        for name in (STATE_FILE, SNAPSHOT_FILE):
            if name in files:
                validate_state(files[name], self.path / name)
        if files[BATCHES_FILE]:
            validate_batches(files[BATCHES_FILE], self.path / BATCHES_FILE)
        return self._save(files, stats, tables, text)

    def _run_files(self, first: int, step: int) -> tuple[dict[str, Any], dict[str, Any], bool, list[int]] | None:
        """A failure judged at ``step``, a skip after other skips since ``first``: nothing was applied since, so the
        live weights and optimizer state with the scaler's state before ``first`` are the state ``first`` began
        from (``snapshot.pt``), and the held batches of ``first``..``step`` re-reach the judged step. None when
        they are not all held (or do not fit ``capture_max_bytes``): the judged step alone is captured."""
        run = self._run
        if run is None or run[0] != first or first not in self._batch_steps:
            return None
        i = self._batch_steps.index(first)
        batches, steps = self._batches[i:], self._batch_steps[i:]
        if steps != list(range(first, step + 1)):
            return None
        st = self.state()
        st["scaler"] = run[2] if run[2] is not None else st["scaler"]
        files: dict[str, Any] = {SNAPSHOT_FILE: st, RNG_FILE: rng_states(run[1])}
        if sum(nbytes(v) for v in files.values()) + sum(nbytes(b) for b in batches) > self.max_bytes:
            return None
        files[BATCHES_FILE] = list(batches)
        return files, st, run[1] is not None, list(steps)

    def _files(self, step: int, skipped: bool, scaler_before: dict[str, Any] | None,
               left_out: list[str], first: int | None = None) -> tuple[dict[str, Any], dict[str, Any] | None, bool, list[int]]:
        """The tensor files (name → object), within ``capture_max_bytes`` (what did not fit goes to ``left_out``);
        the snapshot kept, whether ``rng.pt`` is the failing step's start, and the steps of the batches kept.
        ``first``: the failure starts at that earlier skip (``Trigger.first``): its state and the batches since."""
        run = self._run_files(first, step) if skipped and first is not None else None
        if run is not None:
            return run
        if first is not None:
            left_out.append(f"the batches of steps {first}-{step - 1} (skipped before the failure was judged; not all "
                            f"held or within capture_max_bytes={self.max_bytes}): the replay starts at step {step}")
        files: dict[str, Any] = {}
        if skipped:  # nothing was applied: the live state is the state before the failing step
            st = self.state()
            st["scaler"] = scaler_before
            files[STATE_FILE] = st
        batches, steps = list(self._batches), list(self._batch_steps)
        # a snapshot taken at this very step precedes its update: it starts an applied failing step's replay
        snap = (self._snapshot if self._snapshot_step is not None
                and (self._snapshot_step < step or (self._snapshot_step == step and not skipped)) else None)
        if snap is not None and steps and steps[0] != self._snapshot_step:
            left_out.append(f"{SNAPSHOT_FILE} (the batches since step {self._snapshot_step} passed capture_hold_bytes="
                            f"{self.hold_bytes}, so it cannot re-reach the step)")
            snap = None
        if snap is not None:
            files[SNAPSHOT_FILE] = snap
        at_start = self._rng is not None and self._rng_step == step
        files[RNG_FILE] = rng_states(self._rng if at_start else None)
        budget = self.max_bytes - sum(nbytes(v) for v in files.values())
        # the failing batch first in priority, then the ones before it, newest first
        kept: list[int] = []
        short = ""
        for i in range(len(batches) - 1, -1, -1):
            b = nbytes(batches[i])
            if b > budget:  # by how much: the newest batch left out, against what the budget had left
                short = (f"; the {'failing' if not kept else 'next'} step's batch takes {b} bytes, {b - max(budget, 0)} "
                         f"more than the {max(budget, 0)} left beside the state files")
                break
            budget -= b
            kept.append(i)
        kept.sort()
        if len(kept) < len(batches):
            left_out.append(f"{len(batches) - len(kept)} of {len(batches)} batches (capture_max_bytes={self.max_bytes}{short})")
            if snap is not None and (not kept or kept[0] != 0):
                files.pop(SNAPSHOT_FILE)
                left_out.append(f"{SNAPSHOT_FILE} (its batches did not fit, so it cannot re-reach the step)")
                snap = None
        if budget < 0 and STATE_FILE in files:
            left_out.append(f"{STATE_FILE} is larger than capture_max_bytes; kept anyway: it is the failing step")
        files[BATCHES_FILE] = [batches[i] for i in kept]
        return files, snap, at_start, [steps[i] for i in kept]

    def _manifest(self, trig: Trigger, step: int, skipped: bool, record: dict[str, Any],
                  scaler_before: dict[str, Any] | None) -> dict[str, Any]:
        """The manifest's fields that say what failed and what ran: the step, its figures, the versions, the ranks."""
        rank, world = process_rank()
        return {
            "schema_version": CAPTURE_VERSION,
            "tool": "ampdoctor capture",
            "step": step,
            "reason": trig.reason,
            "detail": trig.detail,
            "skip_reason": record.get("skip_reason", ""),
            "module": _module_of(record.get("skip_reason", "")),
            "skipped": skipped,
            "loss": _num(record.get("loss")),
            "grad_l2_pre_clip": _num(record.get("grad_l2_pre_clip")),
            "lr": _num(record.get("lr")),
            "scale": _num(record.get("scaler_scale")),
            "growth_tracker": scaler_before.get("_growth_tracker") if scaler_before else None,
            "autocast_dtype": self.autocast_dtype,
            "precision": {"float16": "amp" if self.scaler is not None else "fp16_autocast", "bfloat16": "bf16"}.get(
                self.autocast_dtype or "", "fp32"),
            "device": str(next((p.device for p in self.model.parameters()), torch.device("cpu"))),
            "versions": {"ampdoctor": __version__, "torch": torch.__version__},
            "monitor": self.settings,
            "rank": rank,
            "world_size": world,
            "sharded": self.sharded,
            "run_id": self.run_id,
            "model_fingerprint": model_fingerprint(self.model, self.layout),
            **({"shards": self._shards()} if self.sharded and self.layout is not None else {}),
        }

    def _save(self, files: dict[str, Any], stats: StepStats | None, tables: dict[str, str], manifest: str) -> Path:
        """Write the capture into a temporary folder beside ``path``, then claim its name (``_claim``)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}-{threading.get_ident()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            for name, obj in files.items():
                buf = io.BytesIO()
                torch.save(obj, buf)
                (tmp / name).write_bytes(buf.getvalue())
            if stats is not None:
                (tmp / STATS_FILE).write_text(json.dumps(stats_json(stats)))
            for name, table in tables.items():  # the lookback ring's tables (watch.ring)
                (tmp / name).write_text(table, encoding="utf-8")
            (tmp / MANIFEST).write_text(manifest)
            return _claim(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _folder_bytes(path: Path) -> int:
    """The bytes of the files in a capture folder (0 when it cannot be read)."""
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0


def _claim(tmp: Path, path: Path, tries: int = 1000) -> Path:
    """Rename the finished folder ``tmp`` to ``path``, or ``path-1``, ``path-2``...: the first free name.
    The rename is the claim (a directory is never renamed onto a non-empty one), so two processes capturing
    into one folder at once get two numbered folders and neither capture is lost."""
    for _ in range(tries):
        final = free_path(path)
        try:
            os.rename(tmp, final)
            return final
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) and not final.exists():
                raise
    raise OSError(errno.EEXIST, f"no free capture folder name next to {path}")


def _replay_needs(where: Path | None) -> list[str]:
    """What ``triage --from`` needs from a spec for the capture written at ``where`` (``input.origin.replay_needs``)."""
    try:
        return origin.replay_needs(json.loads((Path(str(where)) / MANIFEST).read_text()))
    except (OSError, ValueError):
        return ["build_model()", "loss_fn(output, target)"]


def _num(x: Any) -> float | str | None:
    if x is None or x == "":
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else str(v)


def _module_of(skip_reason: str) -> str | None:
    return skip_reason.split(":", 1)[1] if skip_reason.startswith("nonfinite_grad:") else None


__all__ = ["Capture", "CaptureWarning", "default_hold_bytes", "DEFAULT_MAX_BYTES", "free_path"]
