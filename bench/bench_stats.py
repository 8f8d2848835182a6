"""Directions for the statistics of one step (issue 14), against one plain pass over the same tensors.

    python bench/bench_stats.py [--models deep_mlp,gpt,wide,word_lm] [--repeats 15] [--threads N] [--no-compile]

For each bench model, the tensors the monitor reads in one step (module outputs, the gradients at
them, parameter gradients) are reduced to FP16 stats rows by:

- ``current``: ``stats.StatsBuffer``, exactly as the monitor does;
- ``compiled``: one function (the category of every element from its float32 bits, one
  scatter-add for the counts of every tensor, two scatter-max for absmax / smallest non-zero)
  under ``torch.compile(dynamic=True)``: inductor fuses it into one loop (C++ on the CPU when a
  compiler is present, Triton on CUDA); the compile cost is paid once, outside the timing;
- ``hist16``: one ``bincount`` of the top 16 bits of every float32 per tensor (sign, exponent and
  7 mantissa bits), summed into categories bucket by bucket, and the few buckets that straddle a
  threshold refined exactly by one comparison on their elements; absmax / smallest non-zero as
  ``current`` takes them;

and ``torch._foreach_norm`` (one fused read: about the cost of reading the tensors). Every
direction's rows are checked equal to ``current``'s before it is timed. Medians of interleaved runs.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import step_tensors  # noqa: E402
from models import MODELS  # noqa: E402

from ampdoctor.formats import FP16, Format  # noqa: E402
from ampdoctor.watch.stats import StatsBuffer, _thresholds  # noqa: E402

INF = 0x7F800000
NEG_INF = -8388608


def current(ts: list[torch.Tensor]) -> torch.Tensor:
    buf = StatsBuffer(FP16)
    for i, t in enumerate(ts):
        buf.add(i, t)
    keys, rows = buf.collect()
    order = sorted(range(len(keys)), key=lambda i: keys[i])  # type: ignore[arg-type,return-value]
    return rows[order]


def _rows(counts: torch.Tensor, absmax: torch.Tensor, minnz: torch.Tensor) -> torch.Tensor:
    c = counts.to(torch.float64)  # columns 0 zero 1 underflow 2 subnormal 3 normal 4 overflow 5 +inf 6 NaN 7 -inf
    numel = c.sum(dim=1, keepdim=True)
    return torch.cat([numel, c[:, 0:6], c[:, 7:8], c[:, 6:7], absmax.double()[:, None], minnz.double()[:, None]], dim=1)


def _core(flat: torch.Tensor, seg: torch.Tensor, n: int, uf: int, sub: int, of: int) -> tuple[torch.Tensor, ...]:
    bits = flat.view(torch.int32)
    ai = bits & 0x7FFFFFFF
    cat = ((ai >= 1).long() + (ai >= uf).long() + (ai >= sub).long() + (ai >= of).long() + (ai >= INF).long()
           + (ai > INF).long() + 2 * (bits == NEG_INF).long())
    counts = torch.zeros(n * 8, dtype=torch.int64, device=flat.device).scatter_add_(0, seg * 8 + cat, torch.ones_like(cat))
    fin = torch.where(ai < INF, ai, 0)
    absmax = torch.zeros(n, dtype=torch.int32, device=flat.device).scatter_reduce_(0, seg, fin, "amax")
    neg = torch.where(fin == 0, -INF, -fin)
    negmin = torch.full((n,), -INF, dtype=torch.int32, device=flat.device).scatter_reduce_(0, seg, neg, "amax")
    return counts.view(n, 8), absmax, negmin


class Compiled:
    def __init__(self, fmt: Format, compile_it: bool) -> None:
        self.th = _thresholds(fmt)
        self.fn: Callable[..., Any] = torch.compile(_core, dynamic=True) if compile_it else _core
        self.seg_cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, ts: list[torch.Tensor]) -> torch.Tensor:
        sizes = tuple(t.numel() for t in ts)
        seg = self.seg_cache.get(sizes)
        if seg is None:
            seg = self.seg_cache[sizes] = torch.repeat_interleave(
                torch.arange(len(ts), device=ts[0].device), torch.tensor(sizes, device=ts[0].device))
        flat = torch.cat([t.reshape(-1).float() for t in ts])
        counts, absmax, negmin = self.fn(flat, seg, len(ts), *self.th)
        return _rows(counts, absmax.view(torch.float32), (-negmin).view(torch.float32))


class Hist16:
    """Top-16-bit histogram per tensor, chunked to at most ``chunk`` tensors (n x 65536 bins each)."""

    def __init__(self, fmt: Format, chunk: int = 64) -> None:
        uf, sub, of = _thresholds(fmt)
        self.th = (uf, sub, of)
        top = torch.arange(65536, dtype=torch.int64)
        lo = (top & 0x7FFF) << 16  # the smallest |x| bits in each bucket
        cat = ((lo >= 1).long() + (lo >= uf).long() + (lo >= sub).long() + (lo >= of).long() + (lo >= INF).long()
               + (lo > INF).long())
        cat[top == 0xFF80] = 7  # -inf (its bucket holds only -inf and NaNs: refined below)
        cat[top == 0] = 0
        cat[top == 0x8000] = 0  # ±0 and the tiniest subnormals: refined below
        self.cat = torch.nn.functional.one_hot(cat, 8).double()
        # buckets whose elements are not all in one category: each threshold's, zero's and inf's
        self.straddle = sorted({t >> 16 for t in (1, uf, sub, of, INF + 1)})
        self.chunk = chunk
        self.seg_cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, ts: list[torch.Tensor]) -> torch.Tensor:
        out = []
        for i in range(0, len(ts), self.chunk):
            out.append(self._chunk(ts[i : i + self.chunk]))
        return torch.cat(out)

    def _chunk(self, ts: list[torch.Tensor]) -> torch.Tensor:
        n = len(ts)
        sizes = tuple(t.numel() for t in ts)
        seg = self.seg_cache.get(sizes)
        if seg is None:
            seg = self.seg_cache[sizes] = torch.repeat_interleave(torch.arange(n), torch.tensor(sizes))
        flat = torch.cat([t.reshape(-1).float() for t in ts])
        bits = flat.view(torch.int32)
        top = (bits >> 16) & 0xFFFF
        hist = torch.bincount(seg * 65536 + top, minlength=n * 65536).view(n, 65536)
        st = torch.tensor(self.straddle)
        hist_clean = hist.clone()
        hist_clean[:, st] = 0
        hist_clean[:, st | 0x8000] = 0
        counts = hist_clean.double() @ self.cat  # [n, 8]
        # exact refinement of the straddling buckets: only their elements, compared one by one
        ai = bits & 0x7FFFFFFF
        sel = torch.isin(ai >> 16, st)
        a, s, b = ai[sel], seg[sel], bits[sel]
        uf, sub, of = self.th
        cat = ((a >= 1).long() + (a >= uf).long() + (a >= sub).long() + (a >= of).long() + (a >= INF).long()
               + (a > INF).long() + 2 * (b == NEG_INF).long())
        counts += torch.bincount(s * 8 + cat, minlength=n * 8).view(n, 8).double()
        fin = torch.where(ai < INF, ai, 0)
        absmax = torch.zeros(n, dtype=torch.int32).scatter_reduce_(0, seg, fin, "amax")
        negmin = torch.full((n,), -INF, dtype=torch.int32).scatter_reduce_(0, seg, torch.where(fin == 0, -INF, -fin), "amax")
        return _rows(counts, absmax.view(torch.float32), (-negmin).view(torch.float32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="deep_mlp,gpt,wide,word_lm")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-compile", action="store_true", help="the fused function eagerly (no torch.compile)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {a.repeats} interleaved runs")
    comp = Compiled(FP16, not a.no_compile)
    hist = Hist16(FP16)
    for mname in a.models.split(","):
        torch.manual_seed(0)
        model, make_batch = MODELS[mname]()
        x, y = make_batch(torch.Generator().manual_seed(0))
        ts = [t.detach() for t in step_tensors(copy.deepcopy(model), x, y, device)]
        ref = current(ts)
        t0 = time.perf_counter()
        got = comp(ts)
        first = time.perf_counter() - t0
        assert torch.equal(got, ref), "compiled rows differ"
        assert torch.equal(hist(ts), ref), "hist16 rows differ"
        fns: dict[str, Callable[[], Any]] = {
            "current": lambda ts=ts: current(ts), "compiled": lambda ts=ts: comp(ts),
            "hist16": lambda ts=ts: hist(ts), "_foreach_norm": lambda ts=ts: torch._foreach_norm(ts),
        }
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(a.repeats):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        base = med["_foreach_norm"]
        numel = sum(t.numel() for t in ts)
        print(f"\n{mname}: {len(ts)} tensors, {numel:,} elements (first compiled call {first:.1f} s)")
        for k, m in med.items():
            print(f"  {k:14} {m * 1e3:8.2f} ms  {m / base:6.2f}x one pass")
    print(f"\nrows equal to current's for every model; compiled: {'torch.compile(dynamic=True)' if not a.no_compile else 'eager'}")


if __name__ == "__main__":
    main()
