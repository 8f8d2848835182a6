"""`ampdoctor scaler` on a step log of 1e7 rows: CPU time and peak memory, which must not grow with the rows.

The log is `bench_scaler.py`'s GradScaler history (init 2^16, growth_interval 2000, overflows from 2^18, a bad
batch in 20,000), written once; the command runs in a child process --repeats times. The targets: under 60 s of
CPU time (user + system) and under 300 MiB peak resident memory. --rows-list also runs shorter prefixes of the
same log, to show that the peak does not grow with the rows.

    python bench/bench_scaler_stream.py                      # 1e7 rows, 3 repeats, plus 1e5 and 1e6
    python bench/bench_scaler_stream.py --json scaler.json   # the numbers, also as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scaler import write_log  # noqa: E402

CHILD = (
    "import atexit, resource, sys\n"
    "atexit.register(lambda: print(f'@@peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr))\n"
    "from ampdoctor.cli.app import main\n"
    "sys.argv = ['ampdoctor', 'scaler', sys.argv[1]]\n"
    "main()\n"
)


def run_once(log: Path) -> tuple[float, float, float]:
    """(wall s, CPU s, this child's own peak RSS in MiB) of one `ampdoctor scaler LOG`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, str(log)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode not in (0, 1):
        sys.exit(f"ampdoctor scaler failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    peak = next(int(x.split()[1]) for x in p.stderr.splitlines() if x.startswith("@@peak"))
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), peak / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--rows-list", default="100000,1000000", help="Shorter prefixes of the log to run as well.")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log", type=Path, default=None, help="Reuse (or write and keep) the log here.")
    ap.add_argument("--json", type=Path, default=None, help="Write the numbers here as JSON.")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPU(s), {platform.platform()}, python {sys.version.split()[0]}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        log = args.log or Path(tmp) / "steps.csv"
        if not log.exists():
            write_log(log, args.rows)
        sizes = sorted({int(x) for x in args.rows_list.split(",") if x} | {args.rows})
        for rows in sizes:
            path = log
            if rows != args.rows:
                path = Path(tmp) / f"steps.{rows}.csv"
                with log.open() as src, path.open("w") as dst:
                    for i, line in enumerate(src):
                        if i > rows:
                            break
                        dst.write(line)
            mib = path.stat().st_size / 2**20
            runs = [run_once(path) for _ in range(args.repeats)]
            walls, cpus, peaks = zip(*runs, strict=True)
            r = {"rows": rows, "MiB": round(mib, 1), "cpu_s": [round(c, 2) for c in cpus],
                 "wall_s": [round(w, 2) for w in walls], "peak_rss_MiB": [round(p) for p in peaks]}
            results.append(r)
            print(f"{rows:>11,} rows ({mib:6.1f} MiB): CPU {statistics.median(cpus):.2f} s (min {min(cpus):.2f}, "
                  f"max {max(cpus):.2f}), wall {statistics.median(walls):.2f} s, peak RSS {max(peaks):.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
