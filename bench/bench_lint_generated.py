"""``ampdoctor lint`` on a generated 5 MB file of about 60,000 small functions (code generators write such
files): wall time, CPU time and peak memory of one lint of it, in this process.

    python bench/bench_lint_generated.py            # writes the file to a temporary folder, lints it once
    python bench/bench_lint_generated.py --mb 1     # a smaller file
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

from ampdoctor.lint import Selection, lint_paths

BODY = '''
def f{i}(x):
    y = x * 2 + {i}
    if y > 9:
        return helper(y, {i})
    return y
'''


def generate(mb: float) -> str:
    """The text of a generated module of about ``mb`` megabytes (about 85 bytes a function)."""
    head = "import torch\n\n\ndef helper(a, b):\n    return a - b\n"
    parts, size, i = [head], len(head), 0
    while size < mb * 1_000_000:
        s = BODY.format(i=i)
        parts.append(s)
        size += len(s)
        i += 1
    return "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=5.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "generated.py"
        f.write_text(generate(a.mb))
        nfun = f.read_text().count("\ndef ")
        w, c = time.perf_counter(), time.process_time()
        res = lint_paths([f], Selection())
        wall, cpu = time.perf_counter() - w, time.process_time() - c
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{f.stat().st_size / 1e6:.1f} MB, {nfun} functions: {wall:.1f} s wall, {cpu:.1f} s CPU, "
              f"peak RSS {peak:.0f} MB; {res.files} file(s) checked, {len(res.findings)} finding(s), "
              f"{len(res.errors)} skipped {res.errors[:1]}")
    sys.exit(0)


if __name__ == "__main__":
    main()
