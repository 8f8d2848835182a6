"""Materialise, validate, move and cast the user's batches; split them into model call and target."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ampdoctor.errors import BatchError


@dataclass
class Batches:
    """The batches every stage replays, in order."""

    items: list[Any]
    """Distinct batches taken from the dataloader."""
    cycled: bool
    """True when the dataloader had fewer batches than steps and is replayed from the start."""

    def __getitem__(self, step: int) -> Any:
        return self.items[step % len(self.items)]

    def index(self, step: int) -> int:
        return step % len(self.items)


def materialise(loader: Iterable[Any], steps: int) -> Batches:
    """Take up to ``steps`` batches once; check that each holds at least one tensor."""
    try:
        items = list(itertools.islice(iter(loader), steps))
    except TypeError as e:
        raise BatchError(f"build_dataloader() returned {type(loader).__name__}, which is not iterable ({e})") from None
    if not items:
        raise BatchError("build_dataloader() yielded no batches; return a non-empty iterable of batches")
    for i, b in enumerate(items):
        if not any(isinstance(t, torch.Tensor) for t in _leaves(b)):
            raise BatchError(
                f"batch {i} holds no tensors (got {_describe(b)}); yield a tensor, an (inputs, targets) "
                "tuple or a dict of tensors — tokenize strings in build_dataloader()"
            )
        for t in _leaves(b):
            if isinstance(t, torch.Tensor) and (t.is_complex() or t.dtype == torch.bool and False):
                raise BatchError(f"batch {i} holds a {t.dtype} tensor; ampdoctor supports real tensors")
    return Batches(items, cycled=len(items) < steps)


def _describe(b: Any) -> str:
    if isinstance(b, (list, tuple)):
        return f"{type(b).__name__} of " + ", ".join(sorted({type(x).__name__ for x in b}))
    if isinstance(b, dict):
        return "dict of " + ", ".join(sorted({type(x).__name__ for x in b.values()}))
    return type(b).__name__


def _leaves(b: Any) -> list[Any]:
    if isinstance(b, dict):
        return [x for v in b.values() for x in _leaves(v)]
    if isinstance(b, (list, tuple)):
        return [x for v in b for x in _leaves(v)]
    return [b]


def map_tensors(b: Any, fn: Any) -> Any:
    """Apply fn to every tensor in a nested batch; other values pass through untouched."""
    if isinstance(b, torch.Tensor):
        return fn(b)
    if isinstance(b, dict):
        return type(b)({k: map_tensors(v, fn) for k, v in b.items()}) if type(b) is dict else {k: map_tensors(v, fn) for k, v in b.items()}
    if isinstance(b, tuple):
        return tuple(map_tensors(v, fn) for v in b)
    if isinstance(b, list):
        return [map_tensors(v, fn) for v in b]
    return b


def to_device(b: Any, device: torch.device) -> Any:
    return map_tensors(b, lambda t: t.to(device))


def cast_floating(b: Any, dtype: torch.dtype) -> Any:
    """Cast floating tensors to dtype; integer tensors are never cast."""
    return map_tensors(b, lambda t: t.to(dtype) if t.is_floating_point() else t)


def split(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """(args, kwargs, target) for one batch.

    - ``(inputs, targets)``: model(inputs), target targets; longer tuples pass all but the last.
    - ``{...}``: model(**batch); target ``batch["labels"]`` when present, else the dict itself.
    - a tensor: model(tensor), target the tensor itself (reconstruction).
    """
    if isinstance(batch, dict):
        return (), dict(batch), batch.get("labels", batch)
    if isinstance(batch, (list, tuple)):
        if len(batch) == 1:
            return (batch[0],), {}, None
        return tuple(batch[:-1]), {}, batch[-1]
    return (batch,), {}, batch


def filter_kwargs(model: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keep the batch keys that model.forward accepts (all of them if it takes **kwargs).

    Hugging Face style batches often carry extra fields (ids, raw text) that the model never sees.
    """
    if not kwargs:
        return kwargs
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


@dataclass
class FieldCheck:
    """Non-finite values or outliers of one batch field."""

    field: str
    nonfinite: int
    samples: list[int]
    absmax: float


def fields(batch: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Named floating tensors of a batch: 'inputs', 'targets', 'input_ids', '[0]' ..."""
    if isinstance(batch, torch.Tensor):
        return [(prefix or "batch", batch)] if batch.is_floating_point() else []
    if isinstance(batch, dict):
        return [x for k, v in batch.items() for x in fields(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")]
    if isinstance(batch, (list, tuple)):
        if not prefix and len(batch) == 2:
            names = ["inputs", "targets"]
            return [x for n, v in zip(names, batch, strict=True) for x in fields(v, n)]
        return [x for i, v in enumerate(batch) for x in fields(v, f"{prefix}[{i}]")]
    return []


def check_batch(batch: Any) -> list[FieldCheck]:
    """Per floating field: count of NaN/Inf, the sample indices (dim 0) holding them, finite absmax."""
    out = []
    for name, t in fields(batch):
        t = t.detach()
        bad = ~torch.isfinite(t)
        n_bad = int(bad.sum())
        if t.dim() > 0 and n_bad:
            samples = torch.nonzero(bad.reshape(t.shape[0], -1).any(dim=1)).flatten().tolist()
        else:
            samples = []
        fin = t[torch.isfinite(t)]
        absmax = float(fin.abs().max()) if fin.numel() else 0.0
        out.append(FieldCheck(name, n_bad, samples, absmax))
    return out


def outlier_ratio(batches: Batches, field: str, index: int) -> tuple[float, list[int]]:
    """How many times the batch's absmax in ``field`` exceeds the median over all batches,
    and which samples exceed 1000x that median."""
    absmaxes = []
    for b in batches.items:
        d = dict(fields(b))
        t = d.get(field)
        absmaxes.append(float(t[torch.isfinite(t)].abs().max()) if t is not None and torch.isfinite(t).any() else 0.0)
    med = float(np.median(absmaxes))
    if med <= 0:
        return 1.0, []
    t = dict(fields(batches.items[index]))[field]
    rows = t.detach().abs().nan_to_num(0.0, 0.0, 0.0).reshape(t.shape[0], -1).amax(dim=1) if t.dim() > 0 else t.abs().reshape(1)
    samples = torch.nonzero(rows > 1000 * med).flatten().tolist()
    return absmaxes[index] / med, samples
