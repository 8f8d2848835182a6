"""Run the stages on the user's spec and build the Report."""

from __future__ import annotations

import copy
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampdoctor.capture.folder import Captured
from ampdoctor.capture.read import layout_optimizer, read_capture
from ampdoctor.capture.reassemble import reassemble
from ampdoctor.engine import preflight
from ampdoctor.engine.compiled import compile_facts, uncompiled
from ampdoctor.engine.forward import forward_loss, make_optimizer
from ampdoctor.engine.recheck import hook_check, recheck_fn
from ampdoctor.engine.ring import history_finding
from ampdoctor.engine.run import Replay, Run
from ampdoctor.engine.stages import ProgressFn, StageContext, run_stage
from ampdoctor.engine.starts import build_model, prepare, prepare_checkpoint, skipping
from ampdoctor.errors import CaptureError, UsageError
from ampdoctor.input import origin, rebuild
from ampdoctor.input.batches import (
    Batches,
    BatchKeys,
    KeyedLoss,
    ModelInputs,
    as_micro,
    micro_batches,
    to_device,
)
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.env import environment, resolve_device
from ampdoctor.input.resume import StartState, load_into
from ampdoctor.input.spec import Spec, SpecNames, load_spec, no_spec, spec_importable
from ampdoctor.judge.compiled import compile_outcome
from ampdoctor.judge.measures import stall_ratio
from ampdoctor.judge.rules import Diagnosis, diagnose, not_reproduced, shift_diagnosis
from ampdoctor.ladder import ladder, rung
from ampdoctor.ladder import policy as autocast_policy
from ampdoctor.ladder.compile import compiled_run
from ampdoctor.lint import LintFinding
from ampdoctor.records import StageResult, UserHook
from ampdoctor.report import policy as policy_report
from ampdoctor.report import stages as stage_report
from ampdoctor.report.build import code_findings, enrich, replayed_scaler, shift_steps, stage_summary, worded
from ampdoctor.report.model import Report
from ampdoctor.watch import userhooks
from ampdoctor.watch.model_view import unwrap
from ampdoctor.watch.steplog import StepLogWriter

MAX_SKIP = 10**9
"""The most batches ``--skip-batches`` skips (each is taken from the dataloader and dropped)."""


def user_hooks(model: nn.Module) -> list[str]:
    """Gradient hooks the user's model carries (they can hide overflows from GradScaler), in words."""
    return [h.describe() for h in userhooks.found(model)]


@spec_importable
def triage(
    spec_path: str | Path | Spec | None,
    config: TriageConfig | None = None,
    *,
    names: SpecNames | None = None,
    progress: ProgressFn | None = None,
    argv: list[str] | None = None,
    log_path: str | Path | None = None,
    from_capture: str | Path | None = None,
    checkpoint: str | Path | None = None,
    skip_batches: int = 0,
    script: str | Path | None = None,
    attn_implementation: str | None = None,
    import_outside: bool = False,
) -> tuple[Report, Run]:
    """Run every stage of ``config`` on the spec file and diagnose. Raises AmpDoctorError on bad input.

    Returns the report and the ``Run`` (model, batches, initial state, stage results) it came from.

    ``log_path``: write the target stage's per-step CSV there (overwriting: the caller checks it first).
    ``from_capture``: replay the failing step of a real run from a capture folder (``Monitor(capture=...)``):
    the weights, optimizer and scaler state and the batches come from it, the target is the run's own
    precision, and every step number in the report is the run's own.
    ``checkpoint``: start every stage from a training checkpoint (a dict with model / optimizer / scaler
    entries, a transformers Trainer folder, a Lightning .ckpt, or the spec's ``load_checkpoint``), on
    the dataloader's batches after ``skip_batches``; steps are numbered from the checkpoint's step.
    ``attn_implementation``: the attention a transformers model rebuilt from a checkpoint's config.json runs
    (config.json does not record the run's).
    ``import_outside``: rebuild a spec-free capture's model even where it needs a folder outside this one on the
    import path (``input.origin``).
    ``script``: the training script; ``ampdoctor lint`` checks it and the spec, and the report lists
    what it finds (``report.lint``), the findings that can cause the verdict first.
    """
    cfg = config or TriageConfig()
    device = resolve_device(cfg.device)
    spec = _checked_spec(spec_path, names, from_capture, checkpoint, skip_batches)
    if cfg.batch_keys:  # --batch-keys: every forward and loss of the run takes the fields named
        spec = replace(spec, loss_fn=KeyedLoss(BatchKeys.parse(cfg.batch_keys), spec.loss_fn))
    found = lint_sources(spec.path if spec_path is not None else None, script)  # a bad --script: one line now
    compiled_by_spec: list[str] = []  # a spec that returns torch.compile(model): triage runs the compile rung
    spec = replace(spec, build_model=uncompiled(spec.build_model, compiled_by_spec)) if spec.own_model else spec
    cap: Captured | None = None
    start: StartState | None = None
    start_note = ""
    said: list[str] = []
    if from_capture is not None:
        spec, model, batches, cap, said = prepare_replay(spec, cfg, device, from_capture, import_outside)
        target = cap.precision if cap.precision in ("amp", "bf16") else cfg.target
        cfg = replace(cfg, steps=len(batches.items), target=target, compile=cfg.compile or compiled_run(cap.manifest))
        start = cap.start
    elif checkpoint is not None:
        spec, model, batches, start, start_note, said = prepare_checkpoint(spec, cfg, device, checkpoint, skip_batches, progress,
                                                                            attn_implementation)
    else:
        if skip_batches:
            spec, said = skipping(spec, skip_batches)
        model, batches = prepare(spec, cfg, device, progress)
    cfg = replace(cfg, compile=True) if compiled_by_spec and not cfg.compile else cfg
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    spec_arg = ("" if spec_path is None else str(spec.path if isinstance(spec_path, Spec) else spec_path))
    hooks_now = userhooks.found(model)
    if cap is not None:
        said.extend(_hooks_kept(cap.manifest, hooks_now))
    run = Run(spec, cfg, device, model, batches, init_state, spec_arg=spec_arg or "(none)",
              user_hooks=[h.describe() for h in hooks_now], hook_list=hooks_now,
              start=start_note, step0=start.step0 if start is not None else skip_batches, said=said,
              start_kind=("capture" if cap is not None else "checkpoint" if checkpoint is not None else "init"),
              start_label=(("" if Path(checkpoint).is_dir() else "the checkpoint ") + Path(checkpoint).name
                           if checkpoint is not None else ""))
    report = _stages_and_report(run, cap, start, log_path, progress, argv)
    report.lint = code_findings(found, report.verdict.cause)
    if script is not None:
        report.config["script"] = str(script)
    if checkpoint is not None:
        report.config["checkpoint"] = str(checkpoint)
    if skip_batches:
        report.config["skip_batches"] = skip_batches
    run.reset()
    return report, run


def _stages_and_report(run: Run, cap: Captured | None, start: StartState | None, log_path: str | Path | None,
                       progress: ProgressFn | None, argv: list[str] | None) -> Report:
    """The stages and the report, under the autocast op policy the config and the capture ask for
    (``ladder.policy``: CUDA's emulated on the CPU for ``--autocast-policy cuda`` or a CUDA run's capture)."""
    manifest = cap.manifest if cap is not None else None
    with autocast_policy.using(run.config.autocast_policy, run.device, manifest) as policy:
        _run_stages(run, cap, start, log_path, progress)
        report = build_report(run, argv)
    policy_report.apply(report, policy.facts())
    return report


def _checked_spec(spec_path: str | Path | Spec | None, names: SpecNames | None, from_capture: str | Path | None,
                  checkpoint: str | Path | None, skip_batches: int) -> Spec:
    """The spec (or the stand-in of a replay without one), after the checks of triage's arguments."""
    if from_capture is not None and checkpoint is not None:
        raise UsageError("--from and --checkpoint both say where to start; give one")
    replaying = from_capture is not None or checkpoint is not None
    if spec_path is None:
        if not replaying:
            raise UsageError("no spec: give SPEC.py (build_model() and build_dataloader()), or replay a run without one "
                             "with --from CAPTURE or --checkpoint DIR")
        spec = no_spec(from_capture if from_capture is not None else checkpoint, names)  # type: ignore[arg-type]
    else:
        spec = spec_path if isinstance(spec_path, Spec) else load_spec(spec_path, names, require_data=from_capture is None,
                                                                       require_model=not replaying)
    if not isinstance(skip_batches, int) or isinstance(skip_batches, bool) or skip_batches < 0:
        raise UsageError(f"--skip-batches must be 0 or more (got {skip_batches!r})")
    if skip_batches > MAX_SKIP:
        raise UsageError(f"--skip-batches {str(skip_batches)[:24]}{'...' if len(str(skip_batches)) > 24 else ''} is more "
                         f"batches than a dataloader is skipped through (at most {MAX_SKIP:,}); give the run's position "
                         "within its epoch")
    return spec


def _run_stages(run: Run, cap: Captured | None, start: StartState | None, log_path: str | Path | None,
                progress: ProgressFn | None) -> None:
    """Every stage of the run's config into ``run.results`` (the target's step log to ``log_path``); a capture's
    failing step replayed once more in the run's own precision (``run.replay``: transient or persistent)."""
    cfg, hooked = run.config, bool(run.hook_list)

    def context(name: str, log: StepLogWriter | None = None, snapshot: bool = False) -> StageContext:
        fp32 = run.results.get("fp32")
        bare = name == "compile"  # nothing of ampdoctor's traced into the compiled graph
        return StageContext(run.spec, run.model, run.init_state, run.batches, cfg, run.device, progress, snapshot=snapshot or bare,
                            with_monitor=not bare, track=not bare,
                            log=log, optimizer_state=start.optimizer if start else None,
                            scaler_state=start.scaler if start else None, rng=start.rng if start is not None else None,
                            rng_restored=run.rng_restored, probe_hooks=name == cfg.target and hooked,
                            ref_norms=[r.grad_l2_pre_clip for r in fp32.records] if fp32 is not None and name != "fp32" else None)

    for stage in ladder(cfg):
        name = stage.name
        log = (StepLogWriter(log_path, mode="overwrite", on_error="raise")  # a full disk: one line, exit 2
               if log_path is not None and name == cfg.target else None)
        try:
            run.results[name] = run_stage(stage, context(name, log, snapshot=name == cfg.target))
        finally:
            if log is not None:
                log.close()
    run.compiled = compile_facts(run.results, rung(cfg.target, cfg), run.model, run.spec, run.batches, run.init_state,
                                 run.device)
    if cap is not None:
        # transient or persistent: the failing step in the run's own precision (compiled, if the run was), from the
        # captured state, twice
        own = "compile" if compiled_run(cap.manifest) and "compile" in run.results else cfg.target
        again = run_stage(own, context(own))
        replays = [run.results[own], again]
        ident = cap.manifest.get("model_identity")
        differs = origin.differences(ident.get("modules") if isinstance(ident, dict) else None, unwrap(run.model))
        run.replay = Replay(cap.path, cap.manifest, cap.start.step0, cfg.target,
                            sum(1 for r in replays if _failed(r)), len(replays), [_last(r) for r in replays], cap.ring,
                            differs)


def lint_sources(spec_path: Path | None, script: str | Path | None) -> list[LintFinding]:
    """``ampdoctor lint`` on the spec and the training script, as under AMP (triage's amp stage adds a
    GradScaler), with the selection of the nearest pyproject.toml; a script that is missing or does not
    parse is bad input."""
    from ampdoctor.lint import lint_paths
    from ampdoctor.lint.config import nearest_pyproject, selection

    paths = ([Path(spec_path)] if spec_path is not None else []) + ([Path(script)] if script is not None else [])
    if script is not None and not Path(script).is_file():
        raise UsageError(f"--script {script}: no such file; give the training script that runs this model")
    found: list[LintFinding] = []
    for p in dict.fromkeys(paths):
        res = lint_paths([p], selection(nearest_pyproject(p)), amp=True)
        if res.errors and (spec_path is None or p != paths[0]):
            raise UsageError(f"--script {res.errors[0]}")
        found += res.findings
    return found


def _hooks_kept(manifest: dict[str, Any], now: list[UserHook]) -> list[str]:
    """What the report says of the run's gradient hooks (the capture's ``user_hooks``): kept in the replay when the
    spec's model registers them too, else listed as not re-created."""
    raw = manifest.get("user_hooks")
    run_hooks = [h for h in (UserHook.from_json(d) for d in raw) if h is not None] if isinstance(raw, list) else []
    if not run_hooks:
        return []
    have = {(h.kind, h.target, h.name) for h in now}
    kept = [h for h in run_hooks if (h.kind, h.target, h.name) in have]
    lost = [h for h in run_hooks if (h.kind, h.target, h.name) not in have]
    return stage_report.hooks_kept([h.describe() for h in kept], [h.describe() for h in lost], len(run_hooks))


def _failed(res: StageResult) -> bool:
    """The replay failed again: it raised, went non-finite, or a user's gradient hook was handed a non-finite gradient
    on a step GradScaler then applied (the overflow it hid)."""
    hidden = any(s < len(res.records) and not res.records[s].skipped for s in res.hook_inputs_nonfinite)
    return res.error is not None or res.first_nonfinite_step is not None or hidden


def _last(res: StageResult) -> dict[str, float | None]:
    r = res.records[-1] if res.records else None
    return {"loss": r.loss if r else None, "grad_l2": r.grad_l2_pre_clip if r else None,
            "scale": r.scaler_scale if r else None}


def prepare_replay(spec: Spec, cfg: TriageConfig, device: torch.device, capture: str | Path,
                   trust: bool = False) -> tuple[Spec, nn.Module, Batches, Captured, list[str]]:
    """The model with the captured weights, the captured batches; check the optimizer state fits. A spec
    without ``build_model`` (or none) gets the model the capture's ``model_identity`` describes, and one
    without ``build_optimizer`` the captured optimizer's class and parameter groups. The list says where
    the model and the optimizer came from (report notes)."""
    cap = read_capture(capture)
    said: list[str] = []
    if cap.assembled is not None:  # FSDP1/FSDP2/tensor parallelism: read_capture put every rank's shard together
        said.append(cap.assembled)
    elif cap.manifest.get("sharded") == "deepspeed":  # every rank's pieces
        cap, whole = reassemble(cap)
        said.append(whole)
    elif cap.manifest.get("sharded"):
        raise CaptureError(f"{cap.path}: this capture holds rank {cap.manifest.get('rank')}'s shard of a "
                           f"{cap.manifest['sharded']} model without the layout that reassembles it (a capture of an "
                           "older ampdoctor); the manifest, stats.json and the step logs still say which rank, step and module")
    rb: rebuild.Rebuilt | None = None
    if not spec.own_model:
        rb = rebuild.from_identity(cap.manifest.get("model_identity"), str(cap.path), capture=cap.path, trust=trust)
        rebuild.check_size(rb, sum(t.numel() for t in cap.model.values()), str(cap.path))  # before it is built
        spec = replace(spec, build_model=rb.build)
        if rb.lightning and spec.loss_fn is None:  # its loss is its own training_step, on the whole batch
            spec = replace(spec, loss_fn=rebuild.TrainingStepLoss())
            said.append(stage_report.source(stage_report.Source("rebuilt", text=rb.source, loss="training_step")))
        else:
            spec, loss = _recorded_loss(spec, cap)
            said.append(stage_report.source(stage_report.Source("rebuilt", text=rb.source, name=loss,
                                                                loss="recorded" if loss else "model" if spec.loss_fn is None else "")))
    rebuilt_from_layout = None
    if spec.build_optimizer is None:
        rebuilt_from_layout = layout_optimizer(cap.manifest.get("optimizer_layout"))
        if rebuilt_from_layout is not None:
            spec = replace(spec, build_optimizer=rebuilt_from_layout)
            lay = cap.manifest["optimizer_layout"]
            said.append(stage_report.source(stage_report.Source("layout_optimizer", str(lay.get("class")),
                                                                count=len(lay.get("groups") or []))))
    model = build_model(spec, cfg, device)
    if spec.loss_fn is None and rebuild.is_lightning(model):  # the spec's LightningModule: its training_step
        spec = replace(spec, loss_fn=rebuild.TrainingStepLoss())
        said.append(stage_report.source(stage_report.Source("training_step", type(model).__name__, spec_has_none=True)))
    _load_rebuilt(cap, model, rb)
    if rebuilt_from_layout is None:
        preflight.optimizer(spec, model)  # the spec's own: what it raises names its file and line
    try:  # the optimizer (the spec's, or rebuilt from the capture's layout) and its state must fit the model
        opt = make_optimizer(spec.build_optimizer, model)
        if cap.start.optimizer is not None:
            want = [set(g) for g in opt.param_groups]
            opt.load_state_dict(copy.deepcopy(cap.start.optimizer))
            _optimizer_state_fits(opt, want, cap.path)
    except CaptureError:
        raise
    except Exception as e:
        what = ("layout (manifest field optimizer_layout) cannot be rebuilt" if rebuilt_from_layout is not None
                else "state does not fit build_optimizer()")
        raise CaptureError(f"{cap.path}: the captured optimizer {what} "
                           f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]})") from None
    if cap.start.scaler is not None:
        try:
            torch.amp.GradScaler(device.type).load_state_dict(dict(cap.start.scaler))
        except Exception as e:
            raise CaptureError(f"{cap.path}: the captured GradScaler state cannot be loaded ({type(e).__name__}: {e})") from None
    batches = Batches([as_micro(b, cfg.accumulate) for b in cap.batches], cycled=False)  # a list of `accumulate` micro-batches
    try:
        with torch.no_grad():
            forward_loss(model, to_device(micro_batches(batches[0])[0], device), spec.loss_fn)
    except Exception as e:
        raise CaptureError(f"{cap.path}: the captured batch does not run through the spec's model "
                           f"({type(e).__name__}: {str(e).strip()[:160]}); pass batch= in the form build_dataloader() yields") from None
    cap.start.rng = cap.rng
    return spec, model, batches, cap, said


def _recorded_loss(spec: Spec, cap: Captured) -> tuple[Spec, str]:
    """A spec without ``loss_fn`` replaying a plain model whose run computed the loss outside it: the loss the capture
    read from the run's autograd graph (``manifest["loss_recipe"]``, ``input.origin.loss_fn_of``) and its name."""
    recipe = cap.manifest.get("loss_recipe")
    fn = origin.loss_fn_of(recipe, str(cap.path)) if spec.loss_fn is None and isinstance(recipe, dict) else None
    return (spec, "") if fn is None else (replace(spec, loss_fn=fn), str(recipe.get("fn")))  # type: ignore[union-attr]


def _load_rebuilt(cap: Captured, model: nn.Module, rb: rebuild.Rebuilt | None) -> None:
    """The captured weights into the model; a model rebuilt with constructor arguments the capture could not read
    (their defaults) that does not fit says which."""
    try:
        load_into(cap, model)
    except CaptureError as e:
        if rb is None or not rb.unknown:
            raise
        raise CaptureError(f"{e}; the capture could not read the model's constructor argument(s) {', '.join(rb.unknown[:4])} "
                        "(not literals in the training script), and the defaults are not the run's") from None


def start_of(run: Run) -> str:
    """Where every stage started, as the report says it: 'the initial weights', 'the captured weights at step
    8,217', 'checkpoint-130'."""
    if run.start_kind == "capture":
        return stage_report.start("capture", run.replay.step0) if run.replay is not None else stage_report.start("init", 0)
    return stage_report.start(run.start_kind, run.step0, run.start_label)


def _optimizer_state_fits(opt: torch.optim.Optimizer, want: list[set[str]], where: Path) -> None:
    """``load_state_dict`` takes any param_groups and state: a damaged capture would otherwise fail at the first
    step, reported as a model bug. Each group keeps every hyperparameter the optimizer has, and each state
    tensor the shape of its parameter (or one element: a step count)."""
    for i, (g, keys) in enumerate(zip(opt.param_groups, want, strict=False)):
        lost = sorted(keys - set(g))
        if lost:
            raise CaptureError(f"{where}: the captured optimizer state's param group {i} has no {lost[0]!r}; the "
                               "capture is damaged or from another optimizer (capture again)")
    for p, st in opt.state.items():
        if not isinstance(st, dict):
            raise CaptureError(f"{where}: the captured optimizer state holds {type(st).__name__} for a parameter, not its state")
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.numel() > 1 and tuple(v.shape) != tuple(p.shape):
                raise CaptureError(f"{where}: the captured optimizer state {k!r} is {tuple(v.shape)} for a parameter of "
                                   f"{tuple(p.shape)}; the capture is damaged or from another model (capture again)")


def build_report(run: Run, argv: list[str] | None = None) -> Report:
    """Diagnose the run's stage results and build the Report (the FP32 re-check replays from ``run``)."""
    cfg, results, batches, device = run.config, run.results, run.batches, run.device
    start_words = start_of(run)
    diag = _diagnosis(run, start_words)
    rp = run.replay
    step0 = rp.step0 if rp is not None else run.step0
    verdict, findings, fixes, scaler = worded(diag)
    run.reset()
    fp32 = results.get("fp32")
    ratio = stall_ratio(results[cfg.target], fp32) if fp32 and cfg.target in results and results[cfg.target].records else None
    cfg_dict = asdict(cfg)
    if cfg_dict.get("batch_keys") is None:
        cfg_dict.pop("batch_keys", None)
    if not cfg_dict.get("compile"):
        cfg_dict.pop("compile", None)
    cfg_dict["spec"] = run.spec_arg or str(run.spec.path)
    cfg_dict["start"] = start_words
    if ratio is not None:
        cfg_dict["target_progress_vs_fp32"] = ratio
    report = Report(
        verdict=verdict,
        stages=[stage_summary(r, fp32, step0) for r in results.values()],
        findings=findings,
        layers=diag.layers,
        scaler=scaler,
        fixes=fixes,
        environment=environment(device, argv),
        config=cfg_dict,
        notes=_notes(run),
    )
    enrich(report, results)
    if rp is not None and report.scaler is not None:
        replayed_scaler(report.scaler, results.get("amp"), len(batches.items), rp.manifest)
    _start_config(report, run)
    if step0:
        report.config["step0"] = step0  # the run's number of the first step (plots and tables count from it)
        shift_steps(report, step0, judged=False)
    if rp is not None and rp.ring is not None:  # the steps before the failure, from the capture's ring (run's steps)
        told = history_finding(rp.ring, int(rp.manifest["step"]), report.verdict.first_module, report.verdict.cause)
        if told is not None:
            report.findings.append(told)
    return report


def _diagnosis(run: Run, start_words: str) -> Diagnosis:
    """The rules over the stage results (with the FP32 re-check and the hooks' check replaying from ``run``), a
    replay that did not fail again judged transient, shifted to the run's own steps before any word is written."""
    cfg, results, batches, device = run.config, run.results, run.batches, run.device
    rp = run.replay
    step0 = rp.step0 if rp is not None else run.step0
    recheck = recheck_fn(run.model, run.spec, batches, run.init_state, results, device, step0,
                         "initial" if run.start_kind == "init" else start_words)
    phase = rp.manifest.get("scaler_phase") if rp is not None else None  # (what GradScaler was doing)
    hcheck = hook_check(run.model, run.spec, batches, results, device, run.hook_list)
    diag = diagnose(results, batches, cfg, recheck, device=str(device), model_hooks=run.user_hooks,
                    hook_list=run.hook_list, hook_check=hcheck,
                    scaler_phase=phase if isinstance(phase, str) else None,
                    step0=step0,  # the story in the run's steps
                    resumed=run.start_kind != "init",
                    captured=(str(rp.manifest.get("reason")), int(rp.manifest["step"]) - rp.step0) if rp is not None else None)
    diag = replace(diag, outcome=compile_outcome(diag.outcome, run.compiled, cfg.target))
    if rp is not None:
        transient = not_reproduced(rp.manifest, rp.reproduced, rp.replays, rp.last, rp.precision, rp.step0, str(device),
                                   rp.differs)
        if transient is not None:
            diag = replace(transient, layers=diag.layers, scaler=diag.scaler, scaler_note=diag.scaler_note)
    if step0:
        diag = shift_diagnosis(diag, step0)  # the run's own steps, before any word is written
    diag.outcome.facts.setdefault("start", start_words)  # where the stages started, in the words' own terms
    return diag


def _notes(run: Run) -> list[str]:
    """The report's notes, from what the run was and where it started (``report.stages.notes``)."""
    rp, batches = run.replay, run.batches
    replay = None if rp is None else {
        "capture": rp.capture, "manifest": rp.manifest, "n_steps": len(batches.items), "step0": rp.step0,
        "precision": rp.precision, "reproduced": rp.reproduced, "replays": rp.replays, "differs": rp.differs}
    model_inputs = rp is not None and any(isinstance(b, ModelInputs) for it in batches.items for b in micro_batches(it))
    rng_note = (stage_report.rng(rp is not None, run.rng_restored, run.config.seed, rp.step0 if rp is not None else run.step0,
                                 rp.manifest if rp is not None else None) if rp is not None or run.start else None)
    return stage_report.notes(said=run.said, start_note=run.start, replay=replay, rng_note=rng_note,
                              model_inputs=model_inputs,
                              cycled=(len(batches.items), run.config.steps) if batches.cycled else None,
                              cpu=run.device.type == "cpu")


def _start_config(report: Report, run: Run) -> None:
    """Where the stages started, in the report's config: the capture replayed (and the rank), the start step, the
    RNG states restored."""
    rp = run.replay
    if rp is not None:
        m = rp.manifest
        report.config["from_capture"] = str(rp.capture)
        report.config["replay_step0"] = rp.step0
        if int(m.get("world_size") or 1) > 1:
            report.config["capture_rank"] = m.get("rank")
    if run.start:
        report.config["start_step"] = rp.step0 if rp is not None else run.step0
    if rp is not None or run.start:
        report.config["rng_restored"] = list(run.rng_restored)
