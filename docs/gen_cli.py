"""Generate docs/cli.md from the commands' --help, so the reference cannot go stale.

    python docs/gen_cli.py            # rewrite docs/cli.md
    python docs/gen_cli.py --stdout   # print it (the test compares)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from typer.testing import CliRunner

os.environ["COLUMNS"] = "80"
os.environ["NO_COLOR"] = "1"
os.environ["TERM"] = "dumb"

from ampdoctor.cli.app import app  # noqa: E402


DETAILS = """## Options in detail

The help above is one line an option, at 80 columns; what each one does in full:

`ampdoctor triage`

| option | what it does |
| --- | --- |
| `--steps N` | optimizer steps per stage (a whole number); a shorter dataloader is cycled. Default 50, or `TRIAGE_OPTIONS` |
| `--target TARGET` | what you train with, and what the verdict is about: `amp` (autocast fp16 + GradScaler), `fp16` (`model.half()`, FP16 optimizer state) or `bf16` |
| `--stages LIST` | comma-separated stages to run: `fp32,fp16,amp,bf16`; fp32 always runs, as the reference |
| `--max-norm X` | clip the global L2 gradient norm to X in every stage, as your loop does |
| `--accumulate N` | gradient accumulation: N micro-batches per optimizer step, each loss divided by N |
| `--init-scale`, `--growth-interval`, `--backoff-factor` | the GradScaler settings of your run |
| `--model-fn`, `--data-fn`, `--loss-fn`, `--optimizer-fn NAME` | other names for the spec's functions, so one file can hold several specs |
| `--batch-keys IN[,IN...]:TARGET` | which batch fields are the model's inputs and which the target (`image:label`, `0:1` in a tuple batch); [spec-format.md](spec-format.md#batches) |
| `--script PATH` | your training script: `ampdoctor lint` checks it with the spec, and the report lists what it finds next to the verdict |
| `--from DIR` | replay the failing step of a real run from a capture folder (`Monitor(capture=...)`): its weights, optimizer and scaler state and batches; `build_dataloader()` is then optional ([own-loop.md](own-loop.md)) |
| `--checkpoint PATH` | start every stage from a training checkpoint: a dict with model/optimizer/scaler entries, a transformers Trainer checkpoint folder, a Lightning `.ckpt`, or the spec's `load_checkpoint(model, optimizer, scaler, path)` ([checkpoints.md](checkpoints.md)) |
| `--skip-batches N` | skip N batches of `build_dataloader()` first: where the run was when it saved the checkpoint |
| `--attn-implementation NAME` | with `--checkpoint` and no `build_model()`: the attention the run's transformers model used (`eager`, `sdpa`, ...); a Trainer's `config.json` does not record it |
| `--nproc N` | with `--from` a sharded capture: replay the ranks' shards on N CPU processes (gloo) under the run's layout (FSDP2, FSDP1, tensor parallelism, FSDP2 x tensor parallelism, HSDP) instead of reassembling them on one ([scale-out.md](scale-out.md)) |
| `--import-outside` | with `--from` and no `build_model()`: rebuild the capture's model even where that needs a folder outside this one on the import path; only for a capture you trust ([long-runs.md](long-runs.md)) |
| `--json PATH` | the whole report as JSON; `-`: to stdout, and the rest of the output to stderr ([report-format.md](report-format.md)) |
| `--report PATH` | a report to attach to a ticket: `.md` (PNG plots beside it), `.json` or `.html`; repeat it for several |
| `--log PATH` | the target stage's per-step CSV (step, lr, grad_l2_pre_clip, grad_l2_post_clip, loss, skipped, skip_reason, scaler_scale), for `ampdoctor scaler` |
| `--dump-dir DIR` | the offending batch, the weights, module input statistics, the report and a repro script |

`ampdoctor layers`: `--scale X|auto` multiplies the gradients by X before the cast test (a GradScaler scale);
`auto` takes the largest power of two that overflows no gradient. `--sort` orders the rows: `risk` (worst
first), `order` (forward order), `module`, or a column such as `overflow_frac` or `headroom_binades`.
`--underflow-tolerance X`: the underflow fraction a gradient may lose at the smallest scale of its window.
`--report` also writes `.json` (schema: `ampdoctor/schema/layers.schema.json`). See [layers.md](layers.md).
"""


def generate() -> str:
    runner = CliRunner()
    parts = ["# Command-line reference", "", "Generated from `--help` by `python docs/gen_cli.py`; do not edit by hand.", ""]
    for args in ([], ["triage"], ["layers"], ["scaler"], ["lint"], ["check"], ["build-kernel"], ["doctor"]):
        res = runner.invoke(app, [*args, "--help"], prog_name="ampdoctor", env={"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"})
        title = "ampdoctor " + " ".join(args) if args else "ampdoctor"
        text = "\n".join(line.rstrip() for line in res.output.strip("\n").splitlines())
        parts += [f"## `{title}`", "", "```text", text, "```", ""]
    return "\n".join(parts) + "\n" + DETAILS


if __name__ == "__main__":
    text = generate()
    if "--stdout" in sys.argv:
        sys.stdout.write(text)
    else:
        (Path(__file__).parent / "cli.md").write_text(text)
