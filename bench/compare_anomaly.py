"""Where ``torch.autograd.detect_anomaly`` points, next to the autograd node triage names, on the zoo's gradient faults.

    python bench/compare_anomaly.py [--steps 8] [SPEC ...]

For each spec: triage it; when the verdict's finding carries a ``grad_node`` (a gradient fault), replay the failing
step the same way (same weights, batch, precision and loss scale) under ``detect_anomaly(check_nan=True)`` and print
what it raises (the node whose output held NaN) and the last line of the user's code in the forward traceback it
records. One row per spec: verdict, module, triage's node and line, anomaly's node and line.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path

import torch

from ampdoctor import TriageConfig, triage
from ampdoctor.engine.forward import forward_loss
from ampdoctor.input.batches import micro_batches, to_device
from ampdoctor.ladder import FP32, registered, rung

ROOT = Path(__file__).resolve().parent.parent
ZOO = ["sample_models/grad_overflow.py", "sample_models/variance_head.py", "tests/grad_nodes/zero_norm.py",
       "tests/masks/causal_nan_to_num.py", "tests/init_misses/joined_heads.py", "tests/init_misses/ctc_root.py",
       "tests/unseen/join_logvar_mlp.py", "tests/unseen/join_heads_module.py", "tests/unseen/join_token_laplace.py"]


def _user_line(text: str) -> str | None:
    torch_dir = str(Path(torch.__file__).resolve().parent)
    frames = [(f, n) for f, n in re.findall(r'File "([^"]+)", line (\d+)', text)
              if not f.startswith(torch_dir) and "/ampdoctor/" not in f and "/bench/" not in f]
    return f"{Path(frames[-1][0]).name}:{frames[-1][1]}" if frames else None


def anomaly(run, stage: str, step: int) -> tuple[str, str | None]:  # noqa: ANN001
    """(what detect_anomaly says, the user's line in its forward traceback) on the failing step's replay."""
    res = run.results[stage]
    state = run.init_state if stage == "fp32" else res.snapshot
    rec = next(r for r in res.records if r.step == step)
    scale = rec.scaler_scale or 1.0
    run.model.load_state_dict(state)
    prec = rung(stage) if stage in registered() else FP32
    model = prec.cast_model(run.model, run.device)
    batch = to_device(micro_batches(run.batches[step])[0], run.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                loss = forward_loss(model, batch, run.spec.loss_fn, prec)[1]
                (loss.float() * scale).backward()
            said = "nothing (no NaN in any node's output)"
        except RuntimeError as e:
            m = re.search(r"Function '(\w+)' returned nan", str(e))
            said = m.group(1) if m else f"{type(e).__name__}: {str(e)[:80]}"
    trace = "\n".join(str(w.message) for w in caught if "Traceback of forward call" in str(w.message))
    run.model.zero_grad(set_to_none=True)
    return said, _user_line(trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("specs", nargs="*", default=ZOO)
    a = ap.parse_args()
    print("| spec | verdict | module | triage: node, line | detect_anomaly: node, line |")
    print("| --- | --- | --- | --- | --- |")
    for s in a.specs:
        report, run = triage(ROOT / s, TriageConfig(steps=a.steps))
        v = report.verdict
        ev = report.findings[0].evidence if report.findings else {}
        if "grad_node" not in ev:
            print(f"| `{s}` | {v.cause} | {v.first_module} | (no gradient fault) | |")
            continue
        said, line = anomaly(run, v.stage, v.first_step)
        print(f"| `{s}` | {v.cause} at {v.first_step} ({v.stage}) | {v.first_module} | {ev['grad_node']}, "
              f"{ev['grad_line']} | {said}, {line or '-'} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
