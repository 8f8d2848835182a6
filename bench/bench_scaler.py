"""Time and peak memory of `ampdoctor scaler` on a long step log (default 1,000,000 rows).

The log is what a GradScaler with init_scale 2^16 and growth_interval 2000 writes for gradients
that overflow FP16 at scales of 2^18 and above, plus a rare bad batch (1 step in 20000): the
scale climbs, bounces off 2^18, oscillates, and every step's row is there. The command runs in a
child process (as a user runs it); its wall time, CPU time (user + system, less sensitive to a
busy machine) and peak resident memory are reported, the medians over --repeats.

    python bench/bench_scaler.py                  # 1e6 rows, 3 repeats
    python bench/bench_scaler.py --rows 100000 --keep steps.csv
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEADER = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"


def write_log(path: Path, rows: int, seed: int = 0) -> None:
    """A GradScaler history (2^16 start, growth_interval 2000, back-off 0.5) with its losses."""
    rng = random.Random(seed)
    scale, clean = 2.0**16, 0
    with path.open("w") as f:
        f.write(HEADER)
        for step in range(rows):
            skip = scale >= 2.0**18 or rng.random() < 1 / 20000
            loss = 2.0 / (1 + step / 10000) + rng.random() * 0.01
            grad = 1.0 + rng.random()
            reason = "nonfinite_grad:head.weight" if skip else ""
            f.write(f"{step},0.001,{grad:.6g},{grad:.6g},{loss:.6g},{int(skip)},{reason},{scale:g}\n")
            if skip:
                scale, clean = scale * 0.5, 0
            else:
                clean += 1
                if clean == 2000:
                    scale, clean = scale * 2.0, 0


def run_once(log: Path) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS in MiB) of one `ampdoctor scaler LOG` in a child process."""
    code = "import sys; from ampdoctor.cli.app import main; sys.argv = ['ampdoctor', 'scaler', sys.argv[1]]; main()"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if p.returncode not in (0, 1):
        sys.exit(f"ampdoctor scaler failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    return wall, cpu, after.ru_maxrss / 1024  # KiB on Linux; the max over the children so far


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="Write the generated log here and keep it.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = args.keep or Path(tmp) / "steps.csv"
        t0 = time.perf_counter()
        write_log(log, args.rows)
        print(f"wrote {args.rows} rows ({log.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
        walls, cpus, peaks = [], [], []
        for _ in range(args.repeats):
            wall, cpu, peak = run_once(log)
            walls.append(wall)
            cpus.append(cpu)
            peaks.append(peak)
            print(f"  ampdoctor scaler: {wall:.2f} s wall, {cpu:.2f} s CPU, peak RSS {peak:.0f} MiB")
        print(f"median of {args.repeats}: {statistics.median(walls):.2f} s wall, {statistics.median(cpus):.2f} s CPU, "
              f"peak RSS {max(peaks):.0f} MiB (python {sys.version.split()[0]}; the CPU time includes importing torch)")


if __name__ == "__main__":
    main()
