"""One-pass statistics on CUDA: a Triton kernel, where Triton is installed; the eager path otherwise.

The rule is the C++ kernel's (``watch.fused``): the category of each element is read from the float32 bit
pattern of |x| against the bit patterns of the format's thresholds (``bits._thresholds``); NaN is every
pattern above +inf's; the largest finite |x| and the smallest non-zero finite |x| are kept as ordered integer
bits. The tensors are concatenated as float32 (FP16 and BF16 widen exactly; a loss scale multiplies first, as
``eager_stats`` does), and the work is cut into blocks that never straddle two tensors, so each program reduces
its block and adds one count per category to its tensor's row with an atomic. One launch for every tensor
of a step, and no host sync: the rows stay on the device for the step's one host copy.

``tests/test_triton_stats.py`` runs it under ``TRITON_INTERPRET=1`` on the CPU against the eager rows on
random bit patterns.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import torch

from ampdoctor.formats import Format
from ampdoctor.records import NCOLS
from ampdoctor.watch.bits import INF_BITS, _thresholds

BLOCK = 1024


@lru_cache(maxsize=1)
def _kernel() -> Any:
    """The jitted kernel, or None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit
    def stats_kernel(x_ptr, start_ptr, len_ptr, seg_ptr, counts_ptr, amax_ptr, amin_ptr, uf, sub, of,
                     BLOCK: tl.constexpr):  # pragma: no cover - compiled by Triton
        pid = tl.program_id(0)
        start = tl.load(start_ptr + pid)
        n = tl.load(len_ptr + pid)
        seg = tl.load(seg_ptr + pid)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        bits = tl.load(x_ptr + start + offs, mask=mask, other=0)
        ai = bits & 0x7FFFFFFF
        inf = 0x7F800000
        one = tl.full((BLOCK,), 1, tl.int32)
        nil = tl.full((BLOCK,), 0, tl.int32)
        zero = tl.sum(tl.where(mask & (ai == 0), one, nil), axis=0)
        under = tl.sum(tl.where(mask & (ai > 0) & (ai < uf), one, nil), axis=0)
        subn = tl.sum(tl.where(mask & (ai >= uf) & (ai < sub), one, nil), axis=0)
        norm = tl.sum(tl.where(mask & (ai >= sub) & (ai < of), one, nil), axis=0)
        over = tl.sum(tl.where(mask & (ai >= of) & (ai < inf), one, nil), axis=0)
        pinf = tl.sum(tl.where(mask & (bits == inf), one, nil), axis=0)
        ninf = tl.sum(tl.where(mask & (ai == inf) & (bits != inf), one, nil), axis=0)
        nan = tl.sum(tl.where(mask & (ai > inf), one, nil), axis=0)
        finite = mask & (ai < inf)
        amax = tl.max(tl.where(finite, ai, nil), axis=0)
        amin = tl.min(tl.where(finite & (ai > 0), ai, tl.full((BLOCK,), inf, tl.int32)), axis=0)
        row = counts_ptr + seg * 8
        tl.atomic_add(row + 0, zero)
        tl.atomic_add(row + 1, under)
        tl.atomic_add(row + 2, subn)
        tl.atomic_add(row + 3, norm)
        tl.atomic_add(row + 4, over)
        tl.atomic_add(row + 5, pinf)
        tl.atomic_add(row + 6, ninf)
        tl.atomic_add(row + 7, nan)
        tl.atomic_max(amax_ptr + seg, amax)
        tl.atomic_min(amin_ptr + seg, amin)

    return stats_kernel


def available(device: torch.device) -> bool:
    """Whether rows for tensors on ``device`` can come from the Triton kernel (CUDA, or Triton's interpreter)."""
    if os.environ.get("AMPDOCTOR_TRITON", "1") in ("0", "false", "no", "off"):
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _kernel() is not None


@lru_cache(maxsize=32)
def _blocks(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(start, length, tensor) of every block: blocks of ``BLOCK`` elements that never straddle two tensors."""
    starts, lens, segs = [], [], []
    off = 0
    for i, n in enumerate(sizes):
        for b in range(0, n, BLOCK):
            starts.append(off + b)
            lens.append(min(BLOCK, n - b))
            segs.append(i)
        off += n
    mk = lambda v: torch.tensor(v, dtype=torch.int32).to(device)  # noqa: E731
    return mk(starts), mk(lens), mk(segs)


def triton_stats(tensors: list[torch.Tensor], fmt: Format, scale: float = 1.0) -> torch.Tensor | None:
    """``eager_stats(tensors, fmt, scale)``'s rows from one Triton launch, or None where Triton is not available."""
    if not tensors:
        return None
    device = tensors[0].device
    if not available(device) or any(t.device != device for t in tensors):
        return None
    if any(t.dtype not in (torch.float32, torch.float16, torch.bfloat16) for t in tensors):
        return None
    sizes = tuple(t.numel() for t in tensors)
    n = len(sizes)
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors]) if n > 1 else tensors[0].reshape(-1).to(torch.float32)
        if scale != 1.0:
            flat = flat * scale
        counts = torch.zeros(n * 8, dtype=torch.int32, device=device)
        amax = torch.zeros(n, dtype=torch.int32, device=device)
        amin = torch.full((n,), INF_BITS, dtype=torch.int32, device=device)
        starts, lens, segs = _blocks(sizes, device)
        if starts.numel():
            uf, sub, of = _thresholds(fmt)
            _kernel()[(starts.numel(),)](flat.contiguous().view(torch.int32), starts, lens, segs, counts, amax, amin,
                                          uf, sub, of, BLOCK=BLOCK)
        c = counts.view(n, 8).to(torch.float64)
        numel = c.sum(dim=1, keepdim=True)
        out = torch.cat([numel, c, amax.view(torch.float32).double()[:, None], amin.view(torch.float32).double()[:, None]],
                        dim=1)
    assert out.shape[1] == NCOLS
    return out


__all__ = ["available", "triton_stats"]
