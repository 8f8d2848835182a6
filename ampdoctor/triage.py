"""Run the stages on the user's spec and build the Report."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ampdoctor import preflight
from ampdoctor.batches import Batches, filter_kwargs, split, to_device
from ampdoctor.config import TriageConfig
from ampdoctor.diagnosis import Recheck, diagnose, stall_ratio
from ampdoctor.env import environment, resolve_device
from ampdoctor.errors import SpecError
from ampdoctor.loading import load_batches
from ampdoctor.opscan import OpRecord, scan_module
from ampdoctor.report import Report, StageSummary
from ampdoctor.report_build import enrich
from ampdoctor.spec import Spec, SpecNames, call_user, load_spec, spec_importable
from ampdoctor.stages import ProgressFn, StageContext, StageResult, get_loss, run_stage
from ampdoctor.steplog import StepLogWriter


def prepare(spec: Spec, cfg: TriageConfig, device: torch.device,
            progress: ProgressFn | None = None) -> tuple[nn.Module, Batches]:
    """Build the model and batches, and check that they run in FP32 with a scalar loss.

    ``progress("batches", n)`` is called as the batches are taken from the dataloader.
    """
    torch.manual_seed(cfg.seed)
    model = call_user(spec.build_model, what="build_model()", path=spec.path)
    if not isinstance(model, nn.Module):
        raise SpecError(f"{spec.path.name}: build_model() returned {type(model).__name__}; return a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise SpecError(f"{spec.path.name}: the model has no trainable parameters")
    model = model.to(device).float()
    preflight.initial_weights(model, spec.path)
    batches = load_batches(spec, cfg.steps, progress)
    preflight.optimizer(spec, model)
    preflight.batches_run(spec, model, batches, device)
    return model, batches


def user_hooks(model: nn.Module) -> list[str]:
    """Gradient hooks the user's model carries (they can hide overflows from GradScaler)."""
    names = {m: n or "<model>" for n, m in model.named_modules()}
    out = []
    for m, n in names.items():
        if getattr(m, "_backward_hooks", None) or getattr(m, "_backward_pre_hooks", None):
            out.append(f"backward hook on module {n}")
    for n, p in model.named_parameters():
        if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None):
            out.append(f"gradient hook on parameter {n}")
    return out


def recheck_fn(model: nn.Module, spec: Spec, batches: Batches, init_state: dict[str, torch.Tensor],
               results: dict[str, StageResult], device: torch.device):  # noqa: ANN201
    """FP32 replay of a step's batch from the initial weights or a stage's snapshot."""

    def run(stage: str, step: int) -> Recheck | None:
        if stage == "initial":
            state, label = init_state, "initial"
        else:
            res = results.get(stage)
            if res is None or res.snapshot is None or res.snapshot_step != step:
                return None
            state, label = res.snapshot, f"stage {stage} before step {step}"
        model.load_state_dict(state)
        model.train()
        model.zero_grad(set_to_none=True)
        args, kwargs, target = split(to_device(batches[step], device))
        try:
            loss = get_loss(model(*args, **filter_kwargs(model, kwargs)), target, spec.loss_fn)
            loss.backward()
        except Exception:
            return None
        grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        lv = float(loss.detach())
        model.zero_grad(set_to_none=True)

        def ops(module: str) -> list[OpRecord]:
            model.load_state_dict(state)
            return scan_module(model, module, lambda: model(*args, **filter_kwargs(model, kwargs)))

        return Recheck(lv, math.isfinite(lv) and grads_ok, label, ops)

    return run


def _summary(res: StageResult, fp32: StageResult | None) -> StageSummary:
    recs = res.records
    fp32_loss = None
    if fp32 is not None and fp32.records and recs:
        fp32_loss = fp32.records[min(len(fp32.records), len(recs)) - 1].loss  # same step, same batch
    return StageSummary(
        name=res.name,
        steps_run=len(recs),
        first_nonfinite_step=res.first_nonfinite_step,
        skipped_steps=res.skipped_steps,
        final_scale=recs[-1].scaler_scale if recs and recs[-1].scaler_scale is not None else None,
        final_loss=recs[-1].loss if recs else None,
        fp32_loss=fp32_loss,
        losses=[r.loss for r in recs],
        scales=[r.scaler_scale for r in recs],
        grad_norms=[r.grad_l2_pre_clip for r in recs],
        error=asdict(res.error) if res.error else None,
        stopped=res.stopped,
        master_weights=res.master_weights,
    )


@spec_importable
def triage(
    spec_path: str | Path,
    config: TriageConfig | None = None,
    *,
    names: SpecNames | None = None,
    progress: ProgressFn | None = None,
    argv: list[str] | None = None,
    log_path: str | Path | None = None,
) -> tuple[Report, dict[str, StageResult]]:
    """Run every stage of ``config`` on the spec file and diagnose. Raises AmpDoctorError on bad input.

    ``log_path``: write the target stage's per-step CSV there (overwriting: the caller checks it first).
    """
    cfg = config or TriageConfig()
    device = resolve_device(cfg.device)
    spec = load_spec(spec_path, names)
    model, batches = prepare(spec, cfg, device, progress)
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hooks = user_hooks(model)
    results: dict[str, StageResult] = {}
    for name in cfg.stage_list():
        log = StepLogWriter(log_path, mode="overwrite") if log_path is not None and name == cfg.target else None
        try:
            ctx = StageContext(spec, model, init_state, batches, cfg, device, progress, snapshot=name == cfg.target, log=log)
            results[name] = run_stage(name, ctx)
        finally:
            if log is not None:
                log.close()
    recheck = recheck_fn(model, spec, batches, init_state, results, device)
    diag = diagnose(results, batches, cfg, recheck, device=str(device), model_hooks=hooks)
    model.load_state_dict(init_state)
    fp32 = results.get("fp32")
    notes = []
    if batches.cycled:
        notes.append(f"the dataloader yields {len(batches.items)} batch(es); they were cycled to make {cfg.steps} steps")
    if device.type == "cpu":
        notes.append("ran on the CPU: CPU autocast keeps softmax, exp, pow, layer_norm, sum and mean in FP16 where "
                     "CUDA autocast runs them in FP32, so a verdict can differ on a GPU")
    ratio = stall_ratio(results[cfg.target], fp32) if fp32 and cfg.target in results and results[cfg.target].records else None
    cfg_dict = asdict(cfg)
    cfg_dict["spec"] = str(spec_path)
    if ratio is not None:
        cfg_dict["target_progress_vs_fp32"] = ratio
    report = Report(
        verdict=diag.verdict,
        stages=[_summary(r, fp32) for r in results.values()],
        findings=diag.findings,
        layers=diag.layers,
        scaler=diag.scaler,
        fixes=diag.fixes,
        environment=environment(device, argv),
        config=cfg_dict,
        notes=notes,
    )
    enrich(report, results)
    return report, results




