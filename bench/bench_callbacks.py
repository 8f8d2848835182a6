"""What ampdoctor's framework integrations cost per optimizer step, and the rank exchange (issue 11).

    python bench/bench_callbacks.py [--parts trainer,lightning,ddp] [--rounds 9] [--steps 16] [--warmup 2]
        [--threads N] [--clock wall|cpu] [--ddp-rounds 15] [--ddp-steps 8] [--ddp-blocks 32]

trainer: the transformers ``Trainer`` on a small BERT (``BertForSequenceClassification``, hidden 64,
2 layers, 4 heads, intermediate 256, vocabulary 1000, sequence 32, batch 8), fp16 with a
``GradScaler("cpu", init_scale=2**10)`` and autocast handed to accelerate as tests/test_integration_trainer.py
does (accelerate makes neither on the CPU). Variants: no callback | ``AmpDoctorCallback(log=...)``
(full per-layer statistics every step) | ``AmpDoctorCallback(log=..., mode="sentinel", full_every=100)``.

lightning: the same BERT in a ``LightningModule`` (AdamW), ``MixedPrecision("16-mixed", "cpu",
scaler=GradScaler("cpu", init_scale=2**10))`` as tests/test_integration_lightning.py does; the same
three variants with Lightning's ``AmpDoctorCallback``.

Each round builds, for each variant in turn (none, full, sentinel; then full, sentinel, none; then
sentinel, none, full; ...), a fresh model from the same seed and a fresh trainer (seed 0, same data),
and trains ``--warmup + --steps`` optimizer steps. A timing callback placed after ampdoctor's records
the time at the end of every step; a step's time is the interval between two step ends (the whole
loop: data, forward, backward, unscale, clip, optimizer, every callback), the first ``--warmup``
steps of every run not counted, so trainer start-up, the monitor's attach and sentinel mode's one
full step (step 0) are not in it. Reported: the median over all rounds' timed steps, the ratio to no
callback, the spread of the per-round ratios (each run's median against the same round's run with
no callback), and for sentinel mode also the cost amortised with its one full step in 100
(sentinel + (full - sentinel) / 100).

ddp: two gloo processes on the CPU (torch.distributed.run, one torch thread each), the same
``Monitor(mode="sentinel")`` with the rank exchange on (``distributed=None``) and off
(``distributed=False``), interleaved step by step; see bench/ddp_exchange_worker.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CLOCK: Callable[[], float] = time.perf_counter
"""What a step is timed with (--clock)."""

VARIANTS = ("none", "ampdoctor full", "ampdoctor sentinel")
VOCAB, SEQ, BATCH = 1000, 32, 8
HERE = Path(__file__).resolve().parent


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=SEQ, num_labels=2))


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g), "labels": torch.tensor(i % 2)}


def callback_kwargs(variant: str, log: Path) -> dict[str, Any] | None:
    if variant == "ampdoctor full":
        return {"log": log}
    if variant == "ampdoctor sentinel":
        return {"log": log, "mode": "sentinel", "full_every": 100}
    return None


def step_times(ends: list[float], warmup: int) -> list[float]:
    """The intervals between step ends, without the first ``warmup`` steps."""
    return [b - a for a, b in zip(ends[warmup - 1:-1], ends[warmup:], strict=True)]


def run_trainer(variant: str, tmp: Path, steps: int, warmup: int) -> list[float]:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from ampdoctor.integrations.transformers import AmpDoctorCallback

    class Timer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(CLOCK())

    timer = Timer()
    kw = callback_kwargs(variant, tmp / f"{variant.replace(' ', '_')}.csv")
    callbacks = ([AmpDoctorCallback(**kw)] if kw is not None else []) + [timer]
    args = TrainingArguments(str(tmp / "trainer"), per_device_train_batch_size=BATCH, max_steps=warmup + steps, use_cpu=True,
                             fp16=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, logging_steps=10**6)
    tr = Trainer(model=bert(), args=args, train_dataset=Data(), callbacks=callbacks)
    tr.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # what accelerate makes on a GPU
    tr.accelerator.native_amp = True
    tr.remove_callback(PrinterCallback)  # the end-of-run metrics line
    tr.train()
    assert tr.state.global_step == warmup + steps
    return step_times(timer.ends, warmup)


def run_lightning(variant: str, tmp: Path, steps: int, warmup: int) -> list[float]:
    import lightning as L
    from lightning.pytorch.plugins import MixedPrecision

    from ampdoctor.integrations.lightning import AmpDoctorCallback

    class Net(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert()

        def training_step(self, batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            return self.bert(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=5e-5)

    class Timer(L.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(CLOCK())

    timer = Timer()
    kw = callback_kwargs(variant, tmp / f"{variant.replace(' ', '_')}.csv")
    callbacks = ([AmpDoctorCallback(**kw)] if kw is not None else []) + [timer]
    L.seed_everything(0, verbose=False)
    net = Net()
    data = torch.utils.data.DataLoader(Data(), batch_size=BATCH, shuffle=False)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=warmup + steps, callbacks=callbacks, plugins=[plugin], logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(tmp / "lightning"))
    quiet()
    tr.fit(net, data)
    assert tr.global_step == warmup + steps
    return step_times(timer.ends, warmup)


def quiet() -> None:
    """Framework chatter off (Lightning sets its loggers' levels on import)."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
                 "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def bench_framework(name: str, run: Callable[[str, Path, int, int], list[float]], a: argparse.Namespace) -> None:
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rounds: dict[str, list[float]] = {v: [] for v in VARIANTS}  # each run's median
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for v in VARIANTS[r % 3:] + VARIANTS[: r % 3]:  # the order rotates from round to round
                got = run(v, Path(tempfile.mkdtemp(dir=tmp)), a.steps, a.warmup)  # a new step log each run
                times[v] += got
                rounds[v].append(statistics.median(got))
    med = {v: statistics.median(t) for v, t in times.items()}
    base = med["none"]
    print(f"\n{name}: {a.rounds} rounds x {a.steps} timed steps per variant ({time.perf_counter() - t0:.0f} s), "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  {'variant':34} {'median ms':>10} {'ratio':>7}   per-round ratios (min-max)")
    for v in VARIANTS:
        per = [x / b for x, b in zip(rounds[v], rounds["none"], strict=True)]
        print(f"  {v:34} {med[v] * 1e3:10.2f} {med[v] / base:7.3f}   {min(per):.3f}-{max(per):.3f}")
    amort = med["ampdoctor sentinel"] + (med["ampdoctor full"] - med["ampdoctor sentinel"]) / 100
    print(f"  {'sentinel, 1 full step in 100':34} {amort * 1e3:10.2f} {amort / base:7.3f}")


def bench_ddp(a: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(HERE / "ddp_exchange_worker.py"), "--json", str(out), "--rounds", str(a.ddp_rounds),
               "--steps", str(a.ddp_steps), "--blocks", str(a.ddp_blocks)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for attempt in (1, 2):  # a gloo rank aborted once in development (not reproduced): say so, and try again
            p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if p.returncode == 0:
                break
            print(f"  ddp worker failed (attempt {attempt}, exit {p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr)
        else:
            raise SystemExit("ddp worker failed twice")
        got = json.loads(out.read_text())
    on, off = "exchange on (distributed=None)", "exchange off (distributed=False)"
    r0 = got["ranks"][0]
    print(f"\nddp: {got['world']} gloo processes, {r0['threads']} torch thread each, {a.ddp_blocks} x (Linear(64,64) -> "
          f"LayerNorm -> GELU), batch 32 per rank ({r0['params']:,} parameters), autocast fp16 + GradScaler, "
          f"Monitor(mode=\"sentinel\", full_every=100); {a.ddp_rounds} rounds x {a.ddp_steps} steps per variant, "
          f"interleaved, wall clock ({time.perf_counter() - t0:.0f} s), load average {got['load']:.1f}")
    print(f"  {'rank':5} {'exchange off ms':>16} {'exchange on ms':>15} {'ratio':>7} {'difference ms':>14} {'all_reduce alone ms':>20} {'exchange path alone ms':>23}")
    for r in got["ranks"]:
        print(f"  {r['rank']:<5} {r[off] * 1e3:16.2f} {r[on] * 1e3:15.2f} {r[on] / r[off]:7.3f} {(r[on] - r[off]) * 1e3:14.2f} "
              f"{r['all_reduce'] * 1e3:20.3f} {r['exchange_path'] * 1e3:23.3f}")
    print(f"  skipped steps (on, off) per rank: {[r['skips'] for r in got['ranks']]}")


def main() -> None:
    global CLOCK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="trainer,lightning,ddp")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run (at least 1)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (time.process_time), steadier on a shared machine (trainer, lightning)")
    ap.add_argument("--ddp-rounds", type=int, default=15)
    ap.add_argument("--ddp-steps", type=int, default=8)
    ap.add_argument("--ddp-blocks", type=int, default=32)
    a = ap.parse_args()
    if a.warmup < 1:
        ap.error("--warmup must be at least 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.clock == "cpu":
        CLOCK = time.process_time
    warnings.filterwarnings("ignore")
    quiet()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, clock {a.clock}, "
          f"load average {os.getloadavg()[0]:.1f}")
    parts = a.parts.split(",")
    if "trainer" in parts:
        import transformers

        print(f"transformers {transformers.__version__}")
        bench_framework("transformers Trainer, BERT hidden 64 x 2 layers, seq 32, batch 8, fp16 + GradScaler",
                        run_trainer, a)
    if "lightning" in parts:
        import lightning

        print(f"lightning {lightning.__version__}")
        bench_framework("Lightning, the same BERT in a LightningModule, MixedPrecision('16-mixed') + GradScaler",
                        run_lightning, a)
    if "ddp" in parts:
        bench_ddp(a)


if __name__ == "__main__":
    main()
