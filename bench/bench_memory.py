"""Peak memory of triage against bare training of the same stages.

    python bench/bench_memory.py [--spec bench/specs/wide_spec.py] [--steps 10] [--device cpu]

Each side runs in a fresh subprocess. The spec is loaded and its batches materialised first; the
figure is the growth of peak memory from there: peak RSS (ru_maxrss) on the CPU,
torch.cuda.max_memory_allocated on CUDA. The bare side runs the same stage loops with no hooks,
no statistics and no diagnosis.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[5])
from bench_triage import run_stages
from ampdoctor.input.config import TriageConfig
from ampdoctor.input.env import resolve_device
from ampdoctor.input.spec import load_spec
from ampdoctor.engine.triage import prepare
spec_path, steps, dev, monitored = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
cfg = TriageConfig(steps=steps, device=dev)
device = resolve_device(dev)
spec = load_spec(spec_path)
model, batches = prepare(spec, cfg, device)
init = {k: v.detach().clone() for k, v in model.state_dict().items()}
def peak():
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if device.type == "cuda":
    torch.cuda.reset_peak_memory_stats(device)
base = peak() if device.type != "cuda" else torch.cuda.memory_allocated(device)
run_stages(spec, model, batches, init, cfg, device, monitored)
print(json.dumps({"base": base, "peak": peak()}))
"""


def run(spec: str, steps: int, device: str, monitored: bool) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, spec, str(steps), device, "1" if monitored else "0",
                          str(Path(__file__).resolve().parent)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default=str(Path(__file__).parent / "specs" / "wide_spec.py"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for _ in range(a.repeats):
        bare = run(a.spec, a.steps, a.device, False)
        full = run(a.spec, a.steps, a.device, True)
        rows.append(((bare["peak"] - bare["base"]) / 2**20, (full["peak"] - full["base"]) / 2**20))
    rows.sort(key=lambda r: r[1] / max(r[0], 1e-9))
    b, f = rows[len(rows) // 2]
    print(f"{Path(a.spec).name}, {a.steps} steps x stages fp32,fp16,amp on {a.device}: peak memory growth "
          f"bare {b:.0f} MiB, triage {f:.0f} MiB, ratio {f / b:.2f} (median of {a.repeats})")


if __name__ == "__main__":
    main()
