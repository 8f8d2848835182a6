"""Find the operation inside a module whose FP32 output first exceeds a format's range.

Hooks see module boundaries only; an overflow inside a functional op (``q @ k.transpose(-2, -1)``
inside ``attn``) needs a look inside. This replays one forward under a TorchFunctionMode that is
active only while the named module runs, and records every op's finite absmax. Used once, at
diagnosis time, never in the training loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ampdoctor.formats import FORMATS, FP16, Format
from ampdoctor.records import MODEL
from ampdoctor.tensors import iter_tensors


@dataclass
class OpRecord:
    index: int
    op: str
    absmax: float
    overflow_frac: float
    """Share of the output's elements at or beyond FP16's overflow threshold."""
    numel: int


class _Scan(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.ops: list[OpRecord] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.depth > 0:
            name = getattr(func, "__name__", str(func))
            if name not in ("__get__", "__set__", "size", "dim", "__len__"):
                vals = [t for t in iter_tensors(out) if t.is_floating_point() and t.numel()]
                if vals:
                    with torch._C.DisableTorchFunction():
                        a = [torch.nan_to_num(t.detach().float(), 0.0, 0.0, 0.0).abs() for t in vals]
                        amax = max(float(x.max()) for x in a)
                        numel = sum(x.numel() for x in a)
                        over = sum(int((x >= FP16.overflow_threshold).sum()) for x in a)
                    self.ops.append(OpRecord(len(self.ops), name.strip("_"), amax, over / numel, numel))
        return out


def _run_inside(model: nn.Module, module_name: str, scan: Any, run: Callable[[], Any]) -> bool:
    """Run ``run()`` (a forward of ``model``) under the dispatch mode ``scan``, whose ``depth`` counts the calls of
    ``module_name`` in progress (its hooks removed after); False when the model has no such module. An exception of the
    forward ends the run: what ``scan`` saw before it stands."""
    target = dict(model.named_modules()).get(module_name)
    if target is None:
        return False

    def enter(*_: Any) -> None:
        scan.depth += 1

    def leave(*_: Any) -> None:
        scan.depth -= 1

    h1 = target.register_forward_pre_hook(enter)
    h2 = target.register_forward_hook(leave)
    try:
        with torch.no_grad(), scan:
            run()
    except Exception:
        pass
    finally:
        h1.remove()
        h2.remove()
    return True


def scan_module(model: nn.Module, module_name: str, run: Callable[[], Any]) -> list[OpRecord]:
    """Run ``run()`` (a forward of ``model``) and return the ops executed inside ``module_name``."""
    scan = _Scan()
    _run_inside(model, module_name, scan, run)
    return scan.ops


@dataclass
class MaskedRows:
    """Softmax rows whose every entry is masked, seen inside a module in one forward: softmax over a row of -inf is
    0/0 = NaN in every precision (a query that may attend to no key). With ``beyond`` (a format's overflow threshold):
    rows whose every entry is finite but at or below minus that threshold (a ``-1e9`` mask), which the format holds
    as -inf: NaN in that format only."""

    op: str
    """'softmax', 'log_softmax', 'scaled_dot_product_attention' or 'multi_head_attention_forward'."""
    rows: int
    """Fully masked rows in the first call that had any."""
    first: tuple[int, ...]
    """Index of the first such row (its leading dimensions: sample, head, query ...)."""
    samples: tuple[int, ...] = ()
    """The samples (first index) holding such rows, at most 16."""
    value: float | None = None
    """``beyond`` rows: the largest entry of the first such row (the mask constant, e.g. -1e9)."""


def _kpm_rows(args: tuple, kwargs: dict, beyond: float | None) -> torch.Tensor | None:
    """``multi_head_attention_forward``: True per (sample, query) whose every key is masked by ``key_padding_mask``
    (True or -inf; with ``beyond``, finite and at or below -beyond) combined with a 2-D ``attn_mask``."""
    kpm, am = kwargs.get("key_padding_mask"), kwargs.get("attn_mask")
    q = args[0] if args else kwargs.get("query")
    if not isinstance(kpm, torch.Tensor) or kpm.dim() != 2 or not isinstance(q, torch.Tensor) or q.dim() != 3:
        return None
    length = q.shape[0]  # (L, N, E): nn.MultiheadAttention hands batch_first inputs over transposed

    def masked(m: torch.Tensor) -> torch.Tensor:
        if m.dtype == torch.bool:
            return m if beyond is None else torch.zeros_like(m)
        return m == float("-inf") if beyond is None else torch.isfinite(m) & (m <= -beyond)

    dead = masked(kpm)[:, None, :].expand(kpm.shape[0], length, kpm.shape[1])
    if isinstance(am, torch.Tensor) and am.dim() == 2:
        dead = dead | masked(am)[None]
    return dead.all(dim=-1)


def _dead_rows(func_name: str, args: tuple, kwargs: dict, beyond: float | None = None) -> torch.Tensor | None:
    """A bool tensor over the rows of a softmax (or of SDPA's mask): True where every entry is masked (-inf; with
    ``beyond``, finite and at or below -beyond)."""
    def dead(x: torch.Tensor, dim: int) -> torch.Tensor:
        if beyond is None:
            return (x == float("-inf")).all(dim=dim)
        return (torch.isfinite(x) & (x <= -beyond)).all(dim=dim)

    if func_name in ("softmax", "log_softmax"):
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and isinstance(dim, int) and x.dim():
            return dead(x, dim)
        return None
    if func_name == "scaled_dot_product_attention":
        m = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if isinstance(m, torch.Tensor) and m.dim():
            if m.dtype == torch.bool:
                rows = (~m).all(dim=-1) if beyond is None else None
            else:
                rows = dead(m, -1)
            q = args[0] if args else kwargs.get("query")
            try:  # the mask broadcasts over heads and queries: count the rows of the attention itself
                return torch.broadcast_to(rows, q.shape[:-1]) if rows is not None and isinstance(q, torch.Tensor) else rows
            except RuntimeError:
                return rows
    if func_name == "multi_head_attention_forward":
        return _kpm_rows(args, kwargs, beyond)
    return None


_MASKED_OPS = ("softmax", "log_softmax", "scaled_dot_product_attention", "multi_head_attention_forward")


class _Masked(TorchFunctionMode):
    def __init__(self, beyond: float | None = None) -> None:
        super().__init__()
        self.depth = 0
        self.beyond = beyond
        self.found: MaskedRows | None = None

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if self.depth > 0 and self.found is None and name in _MASKED_OPS:
            with torch._C.DisableTorchFunction():
                dead = _dead_rows(name, args, kwargs, self.beyond)
                if dead is not None and bool(dead.any()):
                    at = torch.nonzero(dead)
                    first = tuple(int(i) for i in at[0].tolist())
                    samples = tuple(sorted({int(i) for i in at[:, 0].tolist()}))[:16] if dead.dim() else ()
                    value = None
                    if self.beyond is not None and name in ("softmax", "log_softmax"):
                        x = args[0] if args else kwargs["input"]
                        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
                        value = float(x.movedim(dim, -1)[first].max())
                    self.found = MaskedRows(name, int(dead.sum()), first, samples, value)
        return func(*args, **kwargs)


def masked_rows(model: nn.Module, module_name: str, run: Callable[[], Any], beyond: float | None = None) -> MaskedRows | None:
    """Run ``run()`` (a forward of ``model``) and return the first softmax inside ``module_name`` with a row that is
    masked throughout (all -inf; for SDPA, a mask row that allows no key; for ``nn.MultiheadAttention``, a
    ``key_padding_mask`` row), or None. With ``beyond`` (a format's overflow threshold): a row that is finite in FP32
    and at or below -beyond throughout, which that format holds as -inf."""
    scan = _Masked(beyond)
    return scan.found if _run_inside(model, module_name, scan, run) else None


def first_overflowing_op(ops: list[OpRecord], fmt: Format = FP16) -> OpRecord | None:
    """The first op whose FP32 output has a finite value at or beyond the format's overflow threshold."""
    return next((o for o in ops if o.absmax >= fmt.overflow_threshold), None)


@dataclass
class NonfiniteOp:
    """The first op that turned finite inputs into a non-finite output, in one replayed forward."""

    op: str
    module: str | None
    """Innermost module running the op: '<model>' for the root's own code, None outside the model (the loss)."""
    line: str | None
    """'file.py:42' of the code that called the op (the first frame outside torch and ampdoctor)."""
    loss_only: bool = False
    """Only the loss the model returned is non-finite; its other outputs are finite (a loss inside forward)."""


_SKIP = ("__get__", "__set__", "size", "dim", "__len__", "numel", "is_floating_point", "__repr__", "__format__")


def _all_finite(ts: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _user_line() -> str | None:
    import sys
    from pathlib import Path

    torch_dir = str(Path(torch.__file__).resolve().parent)
    own_dir = str(Path(__file__).resolve().parent.parent)  # the ampdoctor package: it runs the user's forward
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(own_dir):
            return None  # ampdoctor called torch directly (an nn.Sequential of torch modules): no line of the user's
        if not fn.startswith(torch_dir) and not fn.startswith("<"):
            return f"{Path(fn).name}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return None


class _FirstNonfinite(TorchFunctionMode):
    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.found: NonfiniteOp | None = None

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if self.found is not None or name in _SKIP:
            return func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            ins = [t for t in iter_tensors((args, kwargs)) if t.is_floating_point() and t.numel()]
            ins_finite = _all_finite(ins)  # before the call: an in-place op overwrites its input
        out = func(*args, **kwargs)
        if ins_finite:
            with torch._C.DisableTorchFunction():
                outs = [t for t in iter_tensors(out) if t.is_floating_point() and t.numel()]
                if outs and not _all_finite(outs):
                    op = name[2:-2] if name.startswith("__") and name.endswith("__") else name  # __mul__ -> mul; keep mul_
                    self.found = NonfiniteOp(op, self.stack[-1] if self.stack else None, _user_line())
        return out


def first_nonfinite_op(model: nn.Module, run: Callable[[], Any]) -> NonfiniteOp | None:
    """Run ``run()`` (a forward of ``model`` and its loss, in the precision under test) and return
    the first op whose inputs are all finite and whose output is not, with the module running it."""
    stack: list[str] = []
    names = {m: n or MODEL for n, m in model.named_modules()}
    handles = []

    def leave(*_: Any) -> None:  # a forward hook must return None, or it replaces the output
        if stack:
            stack.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(lambda *_a, _n=names[m]: stack.append(_n)))
        handles.append(m.register_forward_hook(leave))
    scan = _FirstNonfinite(stack)
    try:
        with torch.no_grad(), scan:
            run()
    except Exception:
        pass
    finally:
        for h in handles:
            h.remove()
    return scan.found


@dataclass
class InnerOp:
    """An op's largest finite |output| in a forward, with the innermost module that ran it."""

    module: str
    """'<model>' for the root's own code."""
    op: str
    absmax: float
    overflow_frac: dict[str, float]
    """Format name → share of its output's elements at or beyond that format's overflow threshold."""
    index: int = 0
    """The order in which the (module, op) pair first ran in the forward."""


class _Inner(TorchFunctionMode):
    """Every op's finite absmax while a module of the model runs, by innermost module and op name."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.worst: dict[tuple[str, str], InnerOp] = {}

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        if self.stack and name not in _SKIP:
            with torch._C.DisableTorchFunction():
                vals = [t.detach() for t in iter_tensors(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
                        and t.numel()]
                if vals:
                    a = [torch.nan_to_num(t.float(), 0.0, 0.0, 0.0).abs() for t in vals]
                    amax = max(float(x.max()) for x in a)
                    op = name[2:-2] if name.startswith("__") and name.endswith("__") else name
                    key = (self.stack[-1], op)
                    old = self.worst.get(key)
                    if old is None or amax > old.absmax:
                        n = sum(x.numel() for x in a)
                        over = {f.name: sum(int((x >= f.overflow_threshold).sum()) for x in a) / n
                                for f in FORMATS.values() if amax >= f.overflow_threshold}
                        self.worst[key] = InnerOp(key[0], op, amax, over, old.index if old else len(self.worst))
        return out


class InnerOps:
    """``with InnerOps(model) as scan: <one forward>``; then ``scan.ops``: each (module, op) pair's largest
    FP32 value, the ops that module hooks never see (``q @ k`` inside an attention module). One forward, at
    diagnosis time; it reads the outputs and changes nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.ops: list[InnerOp] = []
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._mode = _Inner(self._stack)

    def __enter__(self) -> InnerOps:
        for name, m in self.model.named_modules():
            label = name or MODEL
            self._handles.append(m.register_forward_pre_hook(lambda *_, n=label: self._stack.append(n)))
            self._handles.append(m.register_forward_hook(lambda *_, n=label: self._pop(n)))
        self._mode.__enter__()
        return self

    def _pop(self, name: str) -> None:
        if self._stack and self._stack[-1] == name:
            self._stack.pop()

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.ops = sorted(self._mode.worst.values(), key=lambda o: -o.absmax)
