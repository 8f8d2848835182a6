"""Materialise, validate, move and cast the user's batches; split them into model call and target."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ampdoctor.errors import AmpDoctorError, BatchError, UsageError


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


class LoaderError(BatchError):
    """The user's iterator raised while yielding a batch; ``original`` is its exception."""

    def __init__(self, index: int, original: Exception) -> None:
        super().__init__(f"the dataloader raised {type(original).__name__} while yielding batch {index}: "
                         f"{str(original).strip()[:200]}")
        self.index = index
        self.original = original


class CacheFullError(BatchError):
    """The batches would take more host memory than the batch cache allows."""


def materialise(loader: Iterable[Any], steps: int, *, max_bytes: int | None = None, budget_source: str = "",
                progress: Callable[[int], None] | None = None,
                first_batch: Callable[[Iterator[Any]], Any] | None = None) -> Batches:
    """Take up to ``steps`` batches once, onto the host; check that each holds at least one tensor.

    ``max_bytes``: the host memory the batches may take. A loader with a length is refused before
    anything is cached when its first batch times the batches to take is over it; any loader is
    refused as soon as the cached batches pass it. ``progress(n)`` is called with the number of
    batches taken so far. ``first_batch(it)`` fetches the first batch (e.g. under a deadline).
    Raises BatchError (LoaderError when the iterator itself raises).
    """
    try:
        it = iter(loader)
    except TypeError as e:
        raise BatchError(f"build_dataloader() returned {type(loader).__name__}, which is not iterable ({e})") from None
    except Exception as e:
        raise LoaderError(0, e) from None
    sized = _length(loader)
    items: list[Any] = []
    size = _Footprint()
    for i in range(steps):
        try:
            b = (first_batch(it) if first_batch is not None and i == 0 else next(it))
        except StopIteration:
            break
        except AmpDoctorError:
            raise
        except Exception as e:
            raise LoaderError(i, e) from None
        _check_one(i, b)
        b = to_host(b)
        size.add(b)
        if max_bytes is not None:
            # views into a larger storage (windows over one token stream) say nothing about the next batches'
            # memory: then only the running total counts
            if i == 0 and sized is not None and not size.views and size.bytes * min(sized, steps) > max_bytes:
                raise CacheFullError(_over_budget(size.bytes, min(sized, steps), steps, max_bytes, budget_source))
            if size.bytes > max_bytes:
                raise CacheFullError(_over_budget(size.bytes / (i + 1), steps if sized is None else min(sized, steps),
                                                  steps, max_bytes, budget_source))
        items.append(b)
        if progress is not None:
            progress(i + 1)
    if not items:
        raise BatchError("build_dataloader() yielded no batches; return a non-empty iterable of batches")
    return Batches(items, cycled=len(items) < steps)


def _check_one(i: int, b: Any) -> None:
    if not any(isinstance(t, torch.Tensor) for t in _leaves(b)):
        raise BatchError(
            f"batch {i} holds no tensors (got {_describe(b)}); yield a tensor, an (inputs, targets) "
            "tuple or a dict of tensors — tokenize strings in build_dataloader()"
        )
    for t in _leaves(b):
        if isinstance(t, torch.Tensor) and t.is_complex():
            raise BatchError(f"batch {i} holds a {t.dtype} tensor; ampdoctor supports real tensors")


def _length(loader: Any) -> int | None:
    try:
        n = len(loader)
    except Exception:  # no __len__, or an IterableDataset's DataLoader that cannot tell
        return None
    return n if isinstance(n, int) and n >= 0 else None


def _over_budget(per_batch: float, n: int, steps: int, max_bytes: int, source: str) -> str:
    from ampdoctor.input.limits import CACHE_ENV, human_bytes

    fit = int(max_bytes // per_batch) if per_batch > 0 else n
    need = per_batch * n
    src = f" ({source})" if source else ""
    return (f"{n} batches for --steps {steps} need about {human_bytes(need)} of host memory ({human_bytes(per_batch)} per "
            f"batch), more than the {human_bytes(max_bytes)} batch cache{src}: lower --steps to at most {fit}, yield "
            f"smaller batches, or raise the cache with {CACHE_ENV}={max(1, math.ceil(need / 1e9 * 1.1))}")


TENSOR_OVERHEAD = 512
"""Host bytes a cached tensor costs besides its data (Python object, TensorImpl, storage): 200,000
batches of two 1-element float tensors took 1140 bytes a batch of resident memory (torch 2.13, CPU)."""


class _Footprint:
    """Host bytes held by the cached batches; views of one storage count at most that storage's size."""

    def __init__(self) -> None:
        self.bytes = 0
        self.views = False
        """True once a tensor was seen that views a larger storage."""
        self._per_storage: dict[tuple[str, int], tuple[int, int]] = {}

    def add(self, b: Any) -> None:
        for t in _leaves(b):
            if isinstance(t, np.ndarray):
                self.bytes += int(t.nbytes)
            if not isinstance(t, torch.Tensor):
                continue
            n = t.numel() * t.element_size()
            self.bytes += TENSOR_OVERHEAD
            try:
                st = t.untyped_storage()
                key, cap = (str(t.device), st.data_ptr()), st.nbytes()
            except Exception:  # sparse and other storage-less layouts
                self.bytes += n
                continue
            self.views = self.views or cap > n
            seen, cap = self._per_storage.get(key, (0, cap))
            grown = min(seen + n, cap)
            self.bytes += grown - seen
            self._per_storage[key] = (grown, cap)


def to_host(b: Any) -> Any:
    """The batch with its tensors in host memory (an accelerator's memory is left to the model)."""
    return map_tensors(b, lambda t: t.cpu() if t.device.type != "cpu" else t)


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


class ModelInputs:
    """The arguments of one call of the model, as a capture saw them (``Monitor`` without ``batch=``): the
    targets, if the loss needs any, were outside the model, so they are not known (``UNKNOWN_TARGET``)."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"ModelInputs({len(self.args)} args, kwargs {sorted(self.kwargs)})"


class _Unknown:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN_TARGET"


UNKNOWN_TARGET: Any = _Unknown()
"""The target of a ``ModelInputs`` batch: the loop computed its loss outside the model from targets the
capture never saw."""


def map_tensors(b: Any, fn: Any) -> Any:
    """Apply fn to every tensor in a nested batch; other values pass through untouched."""
    if isinstance(b, torch.Tensor):
        return fn(b)
    if isinstance(b, ModelInputs):
        return ModelInputs(tuple(map_tensors(v, fn) for v in b.args), {k: map_tensors(v, fn) for k, v in b.kwargs.items()})
    if isinstance(b, dict):
        return type(b)({k: map_tensors(v, fn) for k, v in b.items()}) if type(b) is dict else {k: map_tensors(v, fn) for k, v in b.items()}
    if isinstance(b, tuple):
        return tuple(map_tensors(v, fn) for v in b)
    if isinstance(b, list):
        out = [map_tensors(v, fn) for v in b]
        return Micro(out) if isinstance(b, Micro) else out
    return b


def to_device(b: Any, device: torch.device) -> Any:
    return map_tensors(b, lambda t: t.to(device))


def cast_floating(b: Any, dtype: torch.dtype) -> Any:
    """Cast floating tensors to dtype; integer tensors are never cast."""
    return map_tensors(b, lambda t: t.to(dtype) if t.is_floating_point() else t)


TARGET_KEYS = ("labels", "label", "targets", "target", "y")
"""The keys a dict batch's targets go by, in the order they are looked for: the first one present is the target."""


@dataclass(frozen=True)
class BatchKeys:
    """Which fields of a batch are the model's inputs and which the target (``--batch-keys IN[,IN...]:TARGET``).

    A field is a dict key, or a position (``0``, ``1``...) in a tuple batch. No target (``image:``): ``loss_fn``
    gets the whole batch."""

    inputs: tuple[str, ...]
    target: str | None

    @classmethod
    def parse(cls, text: str) -> BatchKeys:
        ins, sep, tgt = text.partition(":")
        inputs = tuple(k.strip() for k in ins.split(",") if k.strip())
        if not sep or not inputs:
            raise UsageError(f"--batch-keys takes INPUT[,INPUT...]:TARGET, such as image:label or "
                             f"input_ids,attention_mask:labels (got {text!r})")
        return cls(inputs, tgt.strip() or None)

    def __str__(self) -> str:
        return f"{','.join(self.inputs)}:{self.target or ''}"


class KeyedLoss:
    """The spec's ``loss_fn`` (None: the model's own loss) with the ``BatchKeys`` the run was given; ``batch_loss``
    splits each batch by them."""

    def __init__(self, keys: BatchKeys, loss_fn: Any) -> None:
        self.keys = keys
        self.loss_fn = loss_fn

    def __call__(self, output: Any, target: Any) -> Any:
        """The spec's loss (a caller that split the batch itself), else the model's own (``input.loss``)."""
        from ampdoctor.input.loss import loss_candidate

        return self.loss_fn(output, target) if self.loss_fn is not None else loss_candidate(output)


def split(batch: Any, model: Any = None, keys: BatchKeys | None = None) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """(args, kwargs, target) for one batch.

    - ``(inputs, targets)``: model(inputs), target targets; longer tuples pass all but the last.
    - ``{...}``: the target is the first of ``TARGET_KEYS`` present (else the whole dict). When the model's
      forward takes some of the other keys by name (or takes ``**kwargs``): model(**batch); else the other
      keys holding tensors, in the dict's order, by position: ``{"image", "label"}`` -> model(image).
    - a tensor: model(tensor), target the tensor itself (reconstruction).
    - ``ModelInputs``: model(*args, **kwargs) as captured; target ``UNKNOWN_TARGET``.
    - ``keys`` (``--batch-keys``): those fields, by name when the forward takes them all by name, else by position.
    """
    if isinstance(batch, ModelInputs):
        return batch.args, batch.kwargs, UNKNOWN_TARGET
    if keys is not None:
        return _split_by(batch, model, keys)
    if isinstance(batch, dict):
        tkey = next((k for k in TARGET_KEYS if k in batch), None)
        target = batch[tkey] if tkey is not None else batch
        rest = [k for k in batch if k != tkey]
        names, var_kw = _forward_names(model)
        if model is None or var_kw or any(k in names for k in rest):
            return (), dict(batch), target
        return tuple(batch[k] for k in rest if _has_tensor(batch[k])), {}, target
    if isinstance(batch, (list, tuple)):
        if len(batch) == 1:
            return (batch[0],), {}, None
        return tuple(batch[:-1]), {}, batch[-1]
    return (batch,), {}, batch


def _split_by(batch: Any, model: Any, keys: BatchKeys) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    def get(k: str) -> Any:
        if isinstance(batch, dict) and k in batch:
            return batch[k]
        if isinstance(batch, (list, tuple)) and k.isdigit() and int(k) < len(batch):
            return batch[int(k)]
        have = (f"its keys are {', '.join(map(str, batch))}" if isinstance(batch, dict) else
                f"it is a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) else
                f"it is a {type(batch).__name__}, not a dict or a tuple")
        raise BatchError(f"--batch-keys {keys} names {k!r}, which the batch does not hold ({have})")

    target = get(keys.target) if keys.target is not None else batch
    names, var_kw = _forward_names(model)
    if isinstance(batch, dict) and (var_kw or all(k in names for k in keys.inputs)):
        return (), {k: get(k) for k in keys.inputs}, target
    return tuple(get(k) for k in keys.inputs), {}, target


def _forward_names(model: Any) -> tuple[set[str], bool]:
    """The parameter names model.forward takes by keyword, and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return set(), False
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _has_tensor(v: Any) -> bool:
    return any(isinstance(t, torch.Tensor) for t in _leaves(v))


def describe_call(batch: Any, model: Any = None, keys: BatchKeys | None = None) -> str:
    """How a batch goes to the model and the loss, in the user's words: "model(batch['image']) and
    loss_fn(output, batch['label'])"."""
    if isinstance(batch, Micro) and batch:
        batch = batch[0]
    if isinstance(batch, ModelInputs) or not isinstance(batch, (dict, list, tuple)):
        return ""
    args, kwargs, target = split(batch, model, keys)

    def name(v: Any) -> str:
        if v is batch:
            return "batch"
        items = batch.items() if isinstance(batch, dict) else enumerate(batch)
        return next((f"batch[{k!r}]" for k, x in items if x is v), "?")

    call = ", ".join([name(a) for a in args] + [f"{k}=batch[{k!r}]" for k in filter_kwargs(model, kwargs)])
    return f"model({call}) and loss_fn(output, {name(target) if target is not None else 'None'})"


def filter_kwargs(model: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keep the batch keys that model.forward accepts (all of them if it takes **kwargs).

    Hugging Face style batches often carry extra fields (ids, raw text) that the model never sees.
    """
    if not kwargs:
        return kwargs
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
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
    if isinstance(batch, ModelInputs):
        return [(n, t) for n, t in named_tensors(batch, prefix) if t.is_floating_point()]
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


def _absmaxes(batches: Batches, field: str) -> tuple[list[float], float]:
    """Every batch's finite absmax in ``field`` and their median: once per run (rules ask per event)."""
    cache: dict[str, tuple[list[float], float]] = batches.__dict__.setdefault("_absmax_by_field", {})
    got = cache.get(field)
    if got is None:
        absmaxes = []
        for b in batches.items:
            d = dict(fields(b))
            t = d.get(field)
            absmaxes.append(float(t[torch.isfinite(t)].abs().max()) if t is not None and torch.isfinite(t).any() else 0.0)
        got = cache[field] = (absmaxes, float(np.median(absmaxes)))
    return got


def absmax_ratio(batches: Batches, field: str, index: int) -> float:
    """How many times the batch's absmax in ``field`` exceeds the median over all batches (1.0 when the
    median is 0): ``outlier_ratio``'s first value, without looking at the samples."""
    absmaxes, med = _absmaxes(batches, field)
    return absmaxes[index] / med if med > 0 else 1.0


def outlier_ratio(batches: Batches, field: str, index: int) -> tuple[float, list[int]]:
    """How many times the batch's absmax in ``field`` exceeds the median over all batches,
    and which samples exceed 1000x that median."""
    absmaxes, med = _absmaxes(batches, field)
    if med <= 0:
        return 1.0, []
    t = dict(fields(batches.items[index]))[field]
    rows = t.detach().abs().nan_to_num(0.0, 0.0, 0.0).reshape(t.shape[0], -1).amax(dim=1) if t.dim() > 0 else t.abs().reshape(1)
    samples = torch.nonzero(rows > 1000 * med).flatten().tolist()
    return absmaxes[index] / med, samples


def named_tensors(batch: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a batch, named as in ``fields`` ('inputs', 'targets', 'input_ids', '[0]' ...)."""
    if isinstance(batch, torch.Tensor):
        return [(prefix or "batch", batch)]
    if isinstance(batch, ModelInputs):  # a captured call of the model: its arguments by position and name
        return ([x for i, v in enumerate(batch.args) for x in named_tensors(v, f"{prefix}args[{i}]")]
                + [x for k, v in batch.kwargs.items() for x in named_tensors(v, f"{prefix}{k}")])
    if isinstance(batch, dict):
        return [x for k, v in batch.items() for x in named_tensors(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")]
    if isinstance(batch, (list, tuple)):
        if not prefix and len(batch) == 2:
            return [x for n, v in zip(["inputs", "targets"], batch, strict=True) for x in named_tensors(v, n)]
        return [x for i, v in enumerate(batch) for x in named_tensors(v, f"{prefix}[{i}]")]
    return []


def layout(batch: Any) -> tuple[Any, ...]:
    """What must match for two batches to go through the same model: structure, dtypes and every
    dimension but the first (the batch size may differ, e.g. a short last batch)."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", batch.dtype, tuple(batch.shape[1:]))
    if isinstance(batch, ModelInputs):
        return ("call", layout(batch.args), layout(batch.kwargs))
    if isinstance(batch, dict):
        return ("dict", tuple((k, layout(v)) for k, v in batch.items()))
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, tuple(layout(v) for v in batch))
    return ("value", type(batch).__name__)


def describe_layout(batch: Any) -> str:
    """'inputs (4, 5) float32, targets (4, 1) float32'."""
    return ", ".join(f"{n} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for n, t in named_tensors(batch))


class Micro(list):  # type: ignore[type-arg]
    """The micro-batches of one accumulated step (``--accumulate N``): the step runs forward and
    backward on each, its loss divided by N, and updates once. Public as ``ampdoctor.MicroBatches``:
    ``mon.step(batch=MicroBatches([b1, b2]))`` keeps an accumulated step's batches for its capture."""


MicroBatches = Micro


def as_micro(batch: Any, n: int) -> Any:
    """``batch`` as an accumulated step's micro-batches when it is written as a plain list of ``n`` > 1 of them (the
    step ran ``n`` backward calls, or the spec's ``accumulate`` is ``n``): each element one micro-batch of the same
    layout (``layout``: a short last one allowed), not the parts of one batch (``[inputs, targets]`` differ in
    layout). Anything else is returned as it is; ``Micro`` stays the explicit form."""
    if type(batch) is not list or n < 2 or len(batch) != n:
        return batch
    if not all(named_tensors(b) for b in batch):
        return batch
    first = layout(batch[0])
    if first[0] == "value" or any(layout(b) != first for b in batch[1:]):
        return batch
    return Micro(batch)


def micro_batches(b: Any) -> list[Any]:
    """The micro-batches of a step: the group's, or the batch alone."""
    return list(b) if isinstance(b, Micro) else [b]


def unlisted(batches: Batches, n: int) -> Batches:
    """A dataloader that yields each step as a plain list of its ``n`` micro-batches (``as_micro``): its
    micro-batches in order, for ``grouped`` to group again; any other dataloader's batches as they are."""
    if n < 2 or not batches.items or not isinstance(as_micro(batches.items[0], n), Micro):
        return batches
    return Batches([m for b in batches.items for m in as_micro(b, n)], cycled=batches.cycled)


def grouped(batches: Batches, steps: int, n: int) -> Batches:
    """``steps`` groups of ``n`` micro-batches, taken in order from ``batches`` (cycled like steps are)."""
    if n <= 1:
        return batches
    groups = [Micro(batches[s * n + i] for i in range(n)) for s in range(steps)]
    return Batches(groups, cycled=batches.cycled)
