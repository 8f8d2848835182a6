"""How much of a step's watched tensors a cheap screen could prove all-normal in FP16 (issue 14).

    python bench/bench_screen.py [--models deep_mlp,gpt,word_lm]

The screen: two fused read passes (``torch._foreach_norm`` with ord=inf and ord=-inf) give every
tensor's largest and smallest |x|; a finite tensor with 2^-14 <= min|x| and max|x| < 65504 has every
element a normal FP16 number, so its statistics row follows without the elementwise passes. Only the
tensors that fail the screen would need the full statistics. This prints, per bench model, how many
tensors and what share of the elements pass: the share of the statistics work the screen could save.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import step_tensors  # noqa: E402
from models import MODELS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="deep_mlp,gpt,word_lm")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':10s} {'tensors':>8s} {'pass':>6s} {'elements passing':>17s}")
    for name in a.models.split(","):
        model, batch = MODELS[name]()
        x, y = batch(torch.Generator().manual_seed(0))
        ts = [t.float() for t in step_tensors(model, x, y, torch.device("cpu"))]
        mx = torch.stack(torch._foreach_norm(ts, float("inf")))
        mn = torch.stack(torch._foreach_norm(ts, float("-inf")))
        ok = (mn >= 2.0**-14) & (mx < 65504) & torch.isfinite(mx)
        numel = torch.tensor([t.numel() for t in ts], dtype=torch.float64)
        print(f"{name:10s} {len(ts):8d} {int(ok.sum()):6d} {100 * float(numel[ok].sum() / numel.sum()):16.1f}%")


if __name__ == "__main__":
    main()
