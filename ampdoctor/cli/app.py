"""The command line: options → config, call the core, render, exit code. Nothing else lives here."""

from __future__ import annotations

import logging
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console

from ampdoctor._version import __version__
from ampdoctor.cli.common import boundary, err, fail, out
from ampdoctor.cli.helpstyle import CODE, OUTPUT, REPLAY, RUN, SCALER, HintedCommand, default
from ampdoctor.cli.options import DEVICE_HELP, SPEC_HELP, DataFn, Force, LossFn, ModelFn, OptimizerFn
from ampdoctor.errors import UsageError
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.spec import Spec, SpecNames, importable, load_spec
from ampdoctor.io import write_atomic

if TYPE_CHECKING:
    from ampdoctor.engine.run import Run
    from ampdoctor.report.model import Report

# Import-time notices of libraries the CLI's own process imports, not the user's run: torchao (imported by
# transformers where it is installed) says "Failed to load <CUDA kernel>.so" on every CPU machine, torch's pytree a
# deprecation of torchao's enums. ampdoctor's one line stays one line; their errors still show.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Tells you why mixed-precision (FP16/AMP) training goes NaN or Inf, and what to change.",
)


def _version(value: bool) -> None:
    if value:
        out.print(f"ampdoctor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = None,
) -> None:
    pass


def _spec_options(sp: Spec) -> dict[str, Any]:
    """The spec's TRIAGE_OPTIONS as TriageConfig fields; an unknown key is one line (a typo would
    otherwise be dropped in silence)."""
    known = {f.name for f in fields(TriageConfig)}
    bad = sorted(k for k in sp.options if k not in known)
    if bad:
        raise UsageError(f"{sp.path.name}: TRIAGE_OPTIONS has no option {bad[0]!r}; the options are {', '.join(sorted(known))}")
    opts = dict(sp.options)
    if isinstance(opts.get("stages"), (list, str)):
        st = opts["stages"]
        opts["stages"] = tuple(st.split(",")) if isinstance(st, str) else tuple(st)
    return opts


def _whole(text: str | None, flag: str) -> int | None:
    """A whole-number option read here, so that '1e21' or 'ten' is one line (not Typer's usage panel)."""
    if text is None:
        return None
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise UsageError(f"{flag} takes a whole number such as 50 (got {text!r})") from None


@app.command(cls=HintedCommand, epilog="Details: docs/cli.md, docs/spec-format.md, docs/checkpoints.md.")
@boundary
def triage(
    spec: Annotated[Optional[Path], typer.Argument(metavar="SPEC", help=SPEC_HELP + "; optional with --from or --checkpoint.", show_default=False)] = None,
    steps: Annotated[Optional[str], typer.Option(metavar="N", help="Steps per stage." + default(50), rich_help_panel=RUN)] = None,
    target: Annotated[Optional[str], typer.Option(metavar="TARGET", help="What you train with: amp, fp16, bf16 or fp8." + default("amp"), rich_help_panel=RUN,
                                                                 autocompletion=lambda: ["amp", "fp16", "bf16", "fp8"])] = None,
    fp8_recipe: Annotated[Optional[str], typer.Option("--fp8-recipe", metavar="NAME", help="With --target fp8: tensorwise, rowwise or rowwise_with_gw_hp." + default("tensorwise"), rich_help_panel=RUN)] = None,
    stages: Annotated[Optional[str], typer.Option(metavar="LIST", help="Stages to run, e.g. fp16,amp (fp32 always runs)." + default("fp32,fp16,amp"), rich_help_panel=RUN)] = None,
    device: Annotated[str, typer.Option(metavar="DEVICE", help=DEVICE_HELP, rich_help_panel=RUN)] = "auto",
    seed: Annotated[Optional[int], typer.Option(metavar="N", help="RNG seed set before every stage." + default(0), rich_help_panel=RUN)] = None,
    autocast_policy: Annotated[Optional[str], typer.Option("--autocast-policy", metavar="POLICY", help="The ops autocast casts: native, cuda (CUDA's, emulated on the CPU) or auto." + default("auto"), rich_help_panel=RUN,
                                                           autocompletion=lambda: ["auto", "native", "cuda"])] = None,
    max_norm: Annotated[Optional[float], typer.Option(metavar="X", help="Clip the gradient norm to X in every stage." + default("no clipping"), rich_help_panel=RUN)] = None,
    accumulate: Annotated[Optional[int], typer.Option(metavar="N", help="Micro-batches per optimizer step." + default(1), rich_help_panel=RUN)] = None,
    compile_: Annotated[bool, typer.Option("--compile", help="Also run the target under torch.compile; bisect a compile-only NaN.", rich_help_panel=RUN)] = False,
    init_scale: Annotated[Optional[float], typer.Option(metavar="X", help="GradScaler's init_scale." + default(65536), rich_help_panel=SCALER)] = None,
    growth_interval: Annotated[Optional[int], typer.Option(metavar="N", help="GradScaler's growth_interval." + default(2000), rich_help_panel=SCALER)] = None,
    backoff_factor: Annotated[Optional[float], typer.Option(metavar="X", help="GradScaler's backoff_factor." + default(0.5), rich_help_panel=SCALER)] = None,
    model_fn: ModelFn = "build_model",
    data_fn: DataFn = "build_dataloader",
    loss_fn: LossFn = "loss_fn",
    optimizer_fn: OptimizerFn = "build_optimizer",
    batch_keys: Annotated[Optional[str], typer.Option("--batch-keys", metavar="IN:TARGET", help="A batch's inputs and target, e.g. image:label.", rich_help_panel=CODE)] = None,
    script: Annotated[Optional[Path], typer.Option("--script", metavar="PATH", help="Your training script: lint it into the report.", rich_help_panel=CODE)] = None,
    from_capture: Annotated[Optional[Path], typer.Option("--from", metavar="DIR", help="Replay a run's failing step from its capture.", rich_help_panel=REPLAY)] = None,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", metavar="PATH", help="Start every stage from a training checkpoint.", rich_help_panel=REPLAY)] = None,
    skip_batches: Annotated[int, typer.Option("--skip-batches", metavar="N", help="Skip N batches first (where the checkpoint was).", rich_help_panel=REPLAY)] = 0,
    attn_implementation: Annotated[Optional[str], typer.Option("--attn-implementation", metavar="NAME", help="The attention of a model rebuilt from a checkpoint (eager, sdpa...).", rich_help_panel=REPLAY)] = None,
    nproc: Annotated[Optional[int], typer.Option("--nproc", metavar="N", help="Replay a sharded capture on N CPU processes.", rich_help_panel=REPLAY)] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", metavar="PATH", help="Write the report as JSON ('-': stdout).", rich_help_panel=OUTPUT)] = None,
    report_path: Annotated[Optional[list[Path]], typer.Option("--report", metavar="PATH", help="Write a .md, .html or .json report (repeatable).", rich_help_panel=OUTPUT)] = None,
    log: Annotated[Optional[Path], typer.Option("--log", metavar="PATH", help="Write the target stage's per-step CSV.", rich_help_panel=OUTPUT)] = None,
    dump_dir: Annotated[Optional[Path], typer.Option("--dump-dir", metavar="DIR", help="Save the failing batch, weights and a repro script.", rich_help_panel=OUTPUT)] = None,
    force: Force = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="Print only the verdict line.", rich_help_panel=OUTPUT)] = False,
    import_outside: Annotated[bool, typer.Option("--import-outside", help="With --from: import a model from outside this folder.", rich_help_panel=REPLAY)] = False,
) -> None:
    """Replay your batches through FP32, raw FP16 and AMP and say where the NaN/Inf comes from."""
    from ampdoctor.cli.outputs import check_triage_outputs, is_stdout, stdout_to_stderr

    human = err if is_stdout(json_path) else out  # `--json -`: the JSON alone on stdout
    if (target or "").strip().lower() == "fp8":  # the FP8 ladder (cli/fp8.py)
        from ampdoctor.cli.fp8 import triage_fp8

        extra = {"--compile": compile_, "--checkpoint": checkpoint, "--report": report_path, "--dump-dir": dump_dir,
                 "--log": log, "--nproc": nproc, "--script": script, "--stages": stages}
        raise typer.Exit(triage_fp8(spec, SpecNames(model_fn, data_fn, loss_fn, optimizer_fn), fp8_recipe, _whole(steps, "--steps"),
                                    seed, device, json_path, quiet, human, extra, from_capture))
    try:
        with stdout_to_stderr(is_stdout(json_path)):  # what the spec prints must not corrupt `--json -`
            check_triage_outputs(json_path, report_path, log, dump_dir, force)
            given = {"steps": _whole(steps, "--steps"), "target": target, "seed": seed, "max_norm": max_norm, "init_scale": init_scale,
                     "growth_interval": growth_interval, "backoff_factor": backoff_factor, "accumulate": accumulate,
                     "batch_keys": batch_keys, "compile": compile_ or None, "autocast_policy": autocast_policy, "stages": tuple(s.strip() for s in stages.split(",") if s.strip()) if stages else None}
            names = SpecNames(model_fn, data_fn, loss_fn, optimizer_fn)
            if nproc is not None and from_capture is None:
                raise UsageError("--nproc replays the per-rank captures of a sharded run: give --from CAPTURE_DIR")
            sp, cfg = _spec_and_config(spec, names, given, device, from_capture, checkpoint)
            ranks = _ranks(spec, from_capture, nproc, names)
            from ampdoctor.cli.progress import progress_display
            from ampdoctor.engine.triage import triage as run_triage

            with progress_display(err, cfg.steps, quiet) as progress:
                report, run = run_triage(sp, cfg, names=names, progress=progress, argv=["ampdoctor", *sys.argv[1:]],
                                         log_path=log, from_capture=from_capture, checkpoint=checkpoint,
                                         skip_batches=skip_batches, script=script, attn_implementation=attn_implementation,
                                         import_outside=import_outside)
            if ranks is not None:
                ranks.apply(report)
            written = _write_outputs(report, run, report_path, dump_dir)
    except KeyboardInterrupt:
        kept = f"; the step log {log} holds every finished step" if log is not None and log.exists() else ""
        fail(f"interrupted; no report was written{kept}", 130)
        return
    _show(report, human, json_path, written, quiet)
    raise typer.Exit(report.exit_code)


def _ranks(spec: Path | None, from_capture: Path | None, nproc: int | None, names: SpecNames) -> Any:
    """``--nproc N``: the capture replayed on N ranks under its layout (``engine.shard_replay``), or None."""
    if nproc is None or from_capture is None:
        return None
    from ampdoctor.engine.shard_replay import replay_ranks

    return replay_ranks(spec, from_capture, nproc, names)


def _spec_and_config(spec: Path | None, names: SpecNames, given: dict[str, Any], device: str,
                     from_capture: Path | None, checkpoint: Path | None) -> tuple[Spec | None, TriageConfig]:
    """The spec (loaded once: triage reuses it; none when a replay needs none) and the config: the spec's
    TRIAGE_OPTIONS, then the options given on the command line."""
    replaying = from_capture is not None or checkpoint is not None
    if spec is None and not replaying:
        raise UsageError("no spec: give SPEC.py (build_model() and build_dataloader()), or replay a run without "
                         "one with --from CAPTURE or --checkpoint DIR")
    sp: Spec | None = None
    if spec is not None:
        with importable(spec):
            sp = load_spec(spec, names, require_data=from_capture is None, require_model=not replaying)
    opts = _spec_options(sp) if sp is not None else {}
    opts.update({k: v for k, v in given.items() if v is not None})
    opts["device"] = device
    return sp, TriageConfig(**opts)


def _write_outputs(report: Report, run: Run, report_paths: list[Path] | None, dump_dir: Path | None) -> list[Path]:
    """The --report files and the --dump-dir folder; what was written, for the closing lines."""
    written: list[Path] = []
    if report_paths:
        from ampdoctor.cli.reports import write_report

        for rp in report_paths:
            written.append(write_report(rp, report)[-1])
    if dump_dir is not None:
        from ampdoctor.cli.dump import dump

        dump(dump_dir, report, run)
        written.append(dump_dir)
    return written


def _show(report: Report, human: Console, json_path: Path | None, written: list[Path], quiet: bool) -> None:
    """--json (a file, or stdout alone), then the verdict line (--quiet) or the whole terminal report."""
    from ampdoctor.cli.outputs import is_stdout, write_json_stdout

    if json_path is not None:
        from ampdoctor.render.json import render as render_json

        if is_stdout(json_path):
            write_json_stdout(render_json(report))
        else:
            write_atomic(json_path, render_json(report))
    if quiet:
        v = report.verdict
        human.print(f"{v.cause} module={v.first_module} step={v.first_step} stage={v.stage}", highlight=False, markup=False)
        return
    from ampdoctor.render.terminal import render

    render(report, human)
    for w in ([json_path] if json_path is not None and not is_stdout(json_path) else []) + written:
        human.print(f"report written to {w}", style="dim", highlight=False, markup=False)


# Commands that live in their own modules (one job each) register here.
from ampdoctor.cli.check import check as _check  # noqa: E402
from ampdoctor.cli.doctor import doctor as _doctor  # noqa: E402
from ampdoctor.cli.kernel import build_kernel as _build_kernel  # noqa: E402
from ampdoctor.cli.layers import layers as _layers  # noqa: E402
from ampdoctor.cli.lint import lint as _lint  # noqa: E402
from ampdoctor.cli.scaler import scaler as _scaler  # noqa: E402

app.command("layers", cls=HintedCommand, epilog="Details: docs/layers.md.")(_layers)
app.command("scaler", cls=HintedCommand, epilog="Details: docs/scaler.md.")(_scaler)
app.command("lint", cls=HintedCommand, epilog="Details: docs/lint.md.")(_lint)
app.command("build-kernel", cls=HintedCommand)(_build_kernel)
app.command("doctor", cls=HintedCommand)(_doctor)
app.command("check", cls=HintedCommand, epilog="Details: docs/checkpoints.md.")(_check)


def main() -> None:
    try:
        app(prog_name="ampdoctor")  # `python -m ampdoctor` too: its usage lines and completion say ampdoctor
    except UsageError as e:  # pragma: no cover - raised outside commands
        fail(str(e))


if __name__ == "__main__":
    main()
