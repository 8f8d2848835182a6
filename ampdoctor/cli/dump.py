"""``--dump-dir``: what a maintainer needs to reproduce a failure, in one folder.

Files: ``batch.pt`` (the offending batch, torch.save), ``weights.pt`` (the FP32 weights before the
failing step: the target stage's snapshot when there is one, else the initial weights),
``failure.json`` (cause, stage, step, module, the module's input statistics in the FP32 and the
failing stage), ``report.json`` and ``repro.py`` (loads the spec, the weights and the batch, and
runs the failing step in FP32 and in the failing precision, watching the module). Nothing prints.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ampdoctor.engine.run import Run
from ampdoctor.errors import OutputExistsError, UsageError
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.spec import SpecNames
from ampdoctor.io import write_group
from ampdoctor.records import Col, StageResult, StepStats
from ampdoctor.records import stats_at as _stats_at
from ampdoctor.report.model import Report, _clean

FILES = ("batch.pt", "weights.pt", "failure.json", "report.json", "repro.py")

_COLS = {name.lower(): getattr(Col, name) for name in dir(Col) if name.isupper()}


def check_dump_dir(path: str | Path, force: bool) -> Path:
    """Fail before any work: a non-empty existing folder needs --force; the parent must exist."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--dump-dir {p} is a file; give a folder")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise OutputExistsError(f"--dump-dir {p} is not empty; choose another folder or pass --force")
    if not p.parent.exists():
        raise UsageError(f"folder {p.parent} does not exist; create it first")
    return p


def row_stats(row: np.ndarray) -> dict[str, Any]:
    """A stats row as named numbers (counts, absmax, smallest non-zero |x|)."""
    out: dict[str, Any] = {k: float(row[i]) for k, i in sorted(_COLS.items(), key=lambda kv: kv[1]) if i < len(row)}
    for k in list(out):
        if k not in ("absmax", "min_nonzero"):
            out[k] = int(out[k])
    return out


def module_inputs(st: StepStats | None, module: str | None) -> list[dict[str, Any]]:
    """Statistics of every floating input of ``module``'s calls in a step."""
    if st is None or module is None:
        return []
    out = []
    for n, c in enumerate(x for x in st.calls if x.module == module):
        for j, t in enumerate(c.inputs):
            r = st.act.get(t)
            if r is not None:
                out.append({"call": n, "input": j, **row_stats(r)})
    return out


def _bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


REPRO = '''"""Replay ampdoctor's failing step: {cause} in stage {stage!r} at step {step}, module {module!r}.

Run: python repro.py [cpu|cuda]   (ampdoctor must be importable; the spec file must still exist)
"""

import math
import sys
from pathlib import Path

import torch

from ampdoctor.engine.forward import forward_loss
from ampdoctor.input.batches import to_device
from ampdoctor.input.spec import SpecNames, importable, load_spec
from ampdoctor.ladder import rung

HERE = Path(__file__).resolve().parent
SPEC = {spec!r}
NAMES = SpecNames({names})
STAGE, STEP, MODULE, SEED = {stage!r}, {step!r}, {module!r}, {seed!r}
DEVICE = torch.device(sys.argv[1] if len(sys.argv) > 1 else {device!r})


def run(precision: str) -> None:
    spec = load_spec(SPEC, NAMES)
    torch.manual_seed(SEED)
    model = spec.build_model().to(DEVICE).float()
    model.load_state_dict(torch.load(HERE / "weights.pt", map_location=DEVICE))
    batch = to_device(torch.load(HERE / "batch.pt", weights_only=False), DEVICE)
    policy = rung(precision)  # what the stage computes: fp16 weights, an autocast dtype
    model = policy.cast_model(model)
    seen = []

    def watch(mod, args, out):
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                f = t.detach().float()
                fin = f[torch.isfinite(f)]
                seen.append((t.dtype, int((~torch.isfinite(f)).sum()), float(fin.abs().max()) if fin.numel() else math.nan))

    handle = dict(model.named_modules()).get(MODULE) if MODULE else None
    handle = handle.register_forward_hook(watch) if handle is not None else None
    loss = forward_loss(model, batch, spec.loss_fn, policy)[1]  # the stages' own forward and loss
    loss.backward()
    grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    print(f"{{precision:>5}}: loss {{float(loss.detach()):.6g}}, gradients finite: {{grads_ok}}")
    for dtype, bad, absmax in seen:
        print(f"       {{MODULE}} output ({{dtype}}): {{bad}} non-finite, largest finite |x| {{absmax:.6g}}")
    if handle is not None:
        handle.remove()


with importable(SPEC):  # the spec may import its neighbours lazily
    for p in dict.fromkeys(["fp32", STAGE or "fp32"]):
        run(p)
'''


def dump_files(report: Report, results: dict[str, StageResult], cfg: TriageConfig, spec_path: str | Path,
               batch: Any, initial_weights: dict[str, torch.Tensor], names: SpecNames | None = None) -> dict[str, bytes | str]:
    """The dump folder's files by name (pure: nothing written). ``batch`` is the batch of the failing step."""
    v = report.verdict
    step = v.first_step if v.first_step is not None else 0
    stage = v.stage or cfg.target
    res = results.get(stage)
    if res is not None and res.snapshot is not None and res.snapshot_step == step:
        weights, label = res.snapshot, f"stage {stage} before step {step}"
    else:
        weights, label = initial_weights, "initial (before step 0)"
    failure = {
        "cause": v.cause, "stage": stage, "step": step, "module": v.first_module, "summary": v.summary,
        "weights": label, "seed": cfg.seed, "spec": str(Path(spec_path).resolve()),
        "module_inputs": {"fp32": module_inputs(_stats_at(results.get("fp32"), step), v.first_module),
                          stage: module_inputs(_stats_at(res, step), v.first_module)},
    }
    recs = results["fp32"].records if "fp32" in results else []
    failure["batch_index"] = next((r.batch for r in recs if r.step == step), None)
    nm = names or SpecNames()
    script = REPRO.format(cause=v.cause, stage=stage, step=step, module=v.first_module, spec=str(Path(spec_path).resolve()),
                          names=", ".join(f"{k}={getattr(nm, k)!r}" for k in ("model", "data", "loss", "optimizer")),
                          seed=cfg.seed, device=report.environment.get("device", "cpu"))
    from ampdoctor.render.json import render as render_json

    return {
        "batch.pt": _bytes(batch),
        "weights.pt": _bytes({k: t.detach().cpu() for k, t in weights.items()}),
        "failure.json": json.dumps(_clean(failure), indent=2) + "\n",
        "report.json": render_json(report),
        "repro.py": script,
    }


def write_dump(folder: str | Path, files: dict[str, bytes | str]) -> list[Path]:
    """Write the files into ``folder`` (created when missing) all or nothing: a full disk leaves neither a
    half-written file nor a folder this call created (``io.write_group``)."""
    p = Path(folder)
    return write_group({p / name: data for name, data in files.items()}, what=f"--dump-dir {p}")


def dump(folder: str | Path, report: Report, run: Run) -> list[Path]:
    """Write the dump folder from the run triage made (its exact batches and initial weights)."""
    step = report.verdict.first_step if report.verdict.first_step is not None else 0
    files = dump_files(report, run.results, run.config, run.spec.path, run.batches[step], run.init_state, run.spec.names)
    return write_dump(folder, files)
