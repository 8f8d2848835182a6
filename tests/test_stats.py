"""The FP16 fast path of tensor_stats agrees with the generic bit-pattern path, batched or not."""

from __future__ import annotations

import math

import torch

from ampdoctor.formats import BF16, FP16
from ampdoctor.records import Col
from ampdoctor.watch.stats import StatsBuffer, _fp16_stats, tensor_stats

from .test_formats import spread


def _generic_one(flat: torch.Tensor) -> torch.Tensor:
    h = flat.half()
    a = flat.abs()
    fin = torch.isfinite(flat)
    row = torch.zeros(1, 11, dtype=torch.float64)
    row[0, Col.NUMEL] = flat.numel()
    row[0, Col.ZERO] = int((flat == 0).sum())
    row[0, Col.UNDERFLOW] = int(((h == 0) & (flat != 0)).sum())
    row[0, Col.SUBNORMAL] = int(((h != 0) & (h.abs() < 2.0**-14)).sum())
    row[0, Col.OVERFLOW] = int((torch.isinf(h) & fin).sum())
    row[0, Col.POSINF] = int((flat == math.inf).sum())
    row[0, Col.NEGINF] = int((flat == -math.inf).sum())
    row[0, Col.NAN] = int(torch.isnan(flat).sum())
    row[0, Col.NORMAL] = flat.numel() - row[0, 1:9].sum()
    row[0, Col.ABSMAX] = float(a[fin].max()) if fin.any() else 0.0
    nz = a[fin & (flat != 0)]
    row[0, Col.MIN_NONZERO] = float(nz.min()) if nz.numel() else math.inf
    return row


def test_fast_path_matches_the_cast_batched_with_empty_and_half_tensors() -> None:
    x = spread(20_000, seed=7)
    parts = list(x.split([1, 0, 999, 5000, 0, len(x) - 6000]))
    parts.append(x[:3000].half())  # an FP16 activation: no underflow or overflow possible any more
    got = tensor_stats(parts, FP16)
    want = torch.cat([_generic_one(p.float()) for p in parts])
    assert torch.equal(got, want)


def test_fast_path_equals_the_generic_path() -> None:
    x = spread(30_000, seed=11)
    fast = _fp16_stats(x, (x.numel(),))
    generic = tensor_stats([x], FP16, scale=2.0)  # a scale takes the generic bit-pattern path ...
    regeneric = tensor_stats([x * 2.0], FP16)  # ... and must agree with the fast path on x * 2
    assert torch.equal(generic[:, :Col.ABSMAX], regeneric[:, :Col.ABSMAX])
    assert torch.equal(fast, _generic_one(x))
    # BF16 takes the generic path; FP16 at a power-of-two scale too
    assert tensor_stats([x], BF16)[0, Col.NUMEL] == x.numel()


def test_buffer_batches_and_big_tensors_agree() -> None:
    x = spread(8_000, seed=5)
    buf = StatsBuffer(FP16, flush_numel=3000, big_numel=2500)
    parts = list(x.split([100, 2600, 900, 1500, 100, len(x) - 5200]))
    for i, p in enumerate(parts):
        buf.add(i, p)
    keys, rows = buf.collect()
    assert sorted(keys) == list(range(len(parts)))  # big tensors are reduced at once: rows align with keys
    by_key = dict(zip(keys, rows, strict=True))
    for i, p in enumerate(parts):
        assert torch.equal(by_key[i], tensor_stats([p], FP16)[0])


def test_fp16_sources_batched_alone() -> None:
    x = spread(20_000, seed=9).half()  # overflowing values are already inf, tiny ones 0 or subnormal
    parts = list(x.split([5, 0, 7000, len(x) - 7005]))
    got = tensor_stats(parts, FP16)
    want = torch.cat([_generic_one(p.float()) for p in parts])
    assert torch.equal(got, want)
    assert got[:, Col.UNDERFLOW].sum() == 0 and got[:, Col.OVERFLOW].sum() == 0
    assert got[:, Col.NEGINF].sum() > 0 and got[:, Col.SUBNORMAL].sum() > 0


def test_buffer_mixes_dtypes() -> None:
    x = spread(6_000, seed=4)
    buf = StatsBuffer(FP16)
    buf.add("a", x[:3000])
    buf.add("b", x[3000:].half())
    buf.add("c", x[:10].double())
    keys, rows = buf.collect()
    by_key = dict(zip(keys, rows, strict=True))
    assert torch.equal(by_key["a"], _generic_one(x[:3000])[0])
    assert torch.equal(by_key["b"], _generic_one(x[3000:].half().float())[0])
    assert torch.equal(by_key["c"], _generic_one(x[:10])[0])
