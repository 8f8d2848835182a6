"""CUDA's autocast op policy, emulated on the CPU (``triage --autocast-policy cuda``; ``Rung.autocast_on``).

CPU and CUDA autocast cast different ops: CUDA autocast runs softmax, exp, pow, layer_norm, sum and the
losses in FP32 (PyTorch's ``fp32`` lists), CPU autocast leaves them in the input's dtype, so a CPU replay
of a CUDA run can overflow where the run did not, or the reverse. Under ``cuda_policy`` every torch call
the model makes (a ``TorchFunctionMode``, above autograd, so the casts are recorded as autocast's are)
is cast as CUDA autocast casts it, and CPU autocast is off inside the call.

Where the policy comes from: not a copied list. The first time a function is called with given argument
dtypes, the same call is run once on fake CUDA tensors (``FakeTensorMode``: no data, no GPU needed)
under CUDA autocast, with and without it, and the casts that CUDA autocast adds are read off the
dispatcher: the installed torch's own ``AutocastCUDA`` kernels decide (``_probe``). A call whose casts go
both ways inside one Python call (a composite such as ``F.multi_head_attention_forward``) cannot be cast
from outside: it runs under CPU autocast's policy (its matmuls in the low dtype, its softmax in the input's)
and is reported as not emulated; so is an op
that CUDA runs in a fused kernel of its own (flash / memory-efficient attention, the fused RNN cells),
whose internal precision the CPU kernel does not reproduce.

Not seen by the emulation: backward (as on CUDA: autocast does not cast backward ops; the casts'
gradients run back through the recorded casts), calls made from C++ extensions, and a model's own
``torch.autocast("cuda" | "cpu", enabled=False)`` regions, which run as written.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ampdoctor.input.config import AUTOCAST_POLICIES

POLICIES = AUTOCAST_POLICIES
"""``auto``: the device's own autocast, except a capture of a CUDA run replayed on the CPU (then ``cuda``);
``native``: the device's own autocast; ``cuda``: CUDA's op policy, emulated on the CPU."""

_FUSED = re.compile(r"_flash_|_efficient_|_fused_|_cudnn_attention|_scaled_dot_product_cudnn")
_LOW = (torch.float16, torch.bfloat16)
_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class PolicyLog:
    """What the emulation did in a run: the calls CUDA's policy ran in FP32 on a lower-precision input (where CPU
    autocast keeps the input's dtype), the calls it cast down, and the calls it could not emulate."""

    policy: str
    reason: str = ""
    run_device: str = ""
    dtype: str = ""
    up: Counter[str] = field(default_factory=Counter)
    down: Counter[str] = field(default_factory=Counter)
    mixed: Counter[str] = field(default_factory=Counter)
    fused: Counter[str] = field(default_factory=Counter)

    def facts(self) -> dict[str, Any]:
        """Plain data for the report (``report.policy``)."""
        return {"policy": self.policy, "reason": self.reason, "run_device": self.run_device, "dtype": self.dtype,
                "fp32": sorted(self.up), "lower": sorted(self.down),
                "not_emulated": sorted(self.mixed), "fused": sorted(self.fused)}


_ACTIVE: contextvars.ContextVar[PolicyLog | None] = contextvars.ContextVar("ampdoctor_autocast_policy", default=None)


def resolve(policy: str, device: torch.device, manifest: dict[str, Any] | None) -> tuple[str, str]:
    """(the policy a run uses, why): ``cuda`` only on the CPU; ``auto`` turns to ``cuda`` for a capture whose
    manifest says the run was on a CUDA device."""
    if device.type != "cpu":
        return "native", ""
    if policy == "cuda":
        return "cuda", "asked"
    run_device = str((manifest or {}).get("device") or "")
    if policy == "auto" and run_device.startswith("cuda"):
        return "cuda", "capture"
    return "native", ""


@contextlib.contextmanager
def using(policy: str, device: torch.device, manifest: dict[str, Any] | None = None) -> Iterator[PolicyLog]:
    """Within: every ``autocast_context`` on the CPU follows ``policy`` (``resolve``); yields the run's log."""
    name, reason = resolve(policy, device, manifest)
    log = PolicyLog(name, reason, str((manifest or {}).get("device") or ""))
    token = _ACTIVE.set(log if name == "cuda" else None)
    try:
        yield log
    finally:
        _ACTIVE.reset(token)


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast(device.type, dtype)`` (disabled without a dtype), or CUDA's policy emulated where a
    ``using(..."cuda"...)`` block is active and the device is the CPU."""
    log = _ACTIVE.get()
    if log is None or dtype is None or device.type != "cpu":
        return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
    return cuda_policy(dtype, log)


@contextlib.contextmanager
def cuda_policy(dtype: torch.dtype, log: PolicyLog | None = None) -> Iterator[PolicyLog]:
    """CUDA autocast's op policy with ``dtype`` (float16 or bfloat16) on CPU tensors, for the block.

    CPU autocast is on (so ``torch.is_autocast_enabled("cpu")`` reads as in a CPU autocast region, and a model's
    own ``autocast(enabled=False)`` turns the emulation off where it says) but does not cast: each call runs
    with it off, after the CUDA policy's casts. The CUDA flag is set too, for a model that disables
    ``torch.autocast("cuda")`` by name."""
    if dtype not in _LOW:
        raise ValueError(f"CUDA autocast casts to float16 or bfloat16, not {dtype}")
    log = log if log is not None else PolicyLog("cuda", "asked")
    log.dtype = str(dtype).removeprefix("torch.")
    cuda_was, cuda_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with torch.autocast("cpu", dtype=dtype):
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        try:
            with _CudaPolicyMode(dtype, log):
                yield log
        finally:
            torch.set_autocast_enabled("cuda", cuda_was)
            torch.set_autocast_dtype("cuda", cuda_dtype)


_AUTOCAST_ENTRY = (torch.amp._enter_autocast, torch.amp._exit_autocast)


class _CudaPolicyMode(TorchFunctionMode):
    """Casts each call's floating tensors as CUDA autocast would (``_rule``), then runs it with CPU autocast off."""

    def __init__(self, dtype: torch.dtype, log: PolicyLog) -> None:
        super().__init__()
        self.dtype, self.log = dtype, log

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _AUTOCAST_ENTRY:  # a model's own ``torch.autocast(...)`` entering or leaving: as written
            return func(*args, **kwargs)
        if not torch.is_autocast_enabled("cpu") or torch._C._current_graph_task_id() != -1:
            return func(*args, **kwargs)  # a model's autocast(enabled=False) region; backward (autocast casts no backward op)
        if not torch.is_autocast_enabled("cuda"):  # the model's torch.autocast("cuda", enabled=False): no autocast at all
            return _without_cpu_autocast(func, args, kwargs)
        rule = _rule(func, args, kwargs, self.dtype)
        if rule == "mixed":  # casts both ways inside: CPU autocast's policy runs it (its matmuls in the low dtype)
            self.log.mixed[op_name(func)] += 1
            return func(*args, **kwargs)
        if rule != "native":
            args, kwargs = self._cast(func, rule, args, kwargs)
        return _without_cpu_autocast(func, args, kwargs)

    def _cast(self, func: Callable[..., Any], rule: str, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        name = op_name(func)
        if rule == "fused":
            self.log.fused[name] += 1
            rule = "low"
        to = torch.float32 if rule == "fp32" else self.dtype
        seen: list[torch.dtype] = []

        def cast(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dtype in _ELIGIBLE and t.dtype != to:
                seen.append(t.dtype)
                return t.to(to)
            return t

        new_args, new_kwargs = pytree.tree_map(cast, (args, kwargs))
        if rule == "fp32" and any(d in _LOW for d in seen) and _rule(func, args, kwargs, self.dtype, "cpu") != "fp32":
            self.log.up[name] += 1
        elif rule == "low" and seen:
            self.log.down[name] += 1
        return new_args, new_kwargs


def _without_cpu_autocast(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    torch.set_autocast_enabled("cpu", False)
    try:
        return func(*args, **kwargs)
    finally:
        torch.set_autocast_enabled("cpu", True)


def op_name(func: Callable[..., Any]) -> str:
    """A call's name as a user reads it: ``softmax``, ``exp``, ``matmul`` (``__matmul__``), ``pow`` (``__rpow__``)."""
    name = getattr(func, "__name__", None) or repr(func)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        name = name[1:] if name.startswith("r") and name[1:] in ("pow", "matmul", "add", "mul", "sub", "truediv") else name
    return name


_RULES: dict[tuple[Any, ...], str] = {}


def _rule(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype,
          device: str = "cuda") -> str:
    """What CUDA autocast (or ``device``'s) does to this call: ``native`` (no cast), ``fp32``, ``low`` (to ``dtype``), ``mixed``
    (casts both ways inside: not emulated) or ``fused`` (a CUDA-only fused kernel); probed once per function and
    argument dtypes (``_probe``)."""
    leaves = pytree.tree_leaves((args, kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not any(t.dtype in _ELIGIBLE for t in tensors) or any(t.device.type != "cpu" for t in tensors):
        return "native"
    key = (func, dtype, device, tuple(_sig(x) for x in leaves), tuple(sorted(kwargs)))
    try:
        rule = _RULES.get(key)
    except TypeError:  # an unhashable function: probe every time
        return _probe(func, args, kwargs, dtype, device)
    if rule is None:
        rule = _RULES[key] = _probe(func, args, kwargs, dtype, device)
    return rule


def _sig(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", x.dtype, x.dim())
    if x is None or isinstance(x, (bool, str, torch.dtype)):
        return x
    return type(x).__name__


def _probe(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype,
           device: str = "cuda") -> str:
    """Run the call on fake ``device`` tensors of the same shapes and dtypes with its autocast on and off; the dtypes
    the autocast run adds (casts, ``dtype=`` arguments, outputs) say the rule. Where the call is itself an op
    with an ``AutocastCUDA`` kernel, the first added dtype is its own cast (what follows is inside its
    kernel); a composite's casts must all go one way. Nothing real runs; the CPU RNG is kept."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=False)
    with fake:
        f_args, f_kwargs = pytree.tree_map(functools.partial(_fake, device=device), (args, kwargs))
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # a fake kernel that refuses logs an ERROR
    level, quiet.disabled = quiet.disabled, True
    with torch.random.fork_rng(devices=[]):
        on = _record(func, f_args, f_kwargs, fake, device, True, dtype)
        off = _record(func, f_args, f_kwargs, fake, device, False, dtype)
    quiet.disabled = level
    added = Counter(on) - Counter(off)
    order = [d for rec in on if added[rec] > 0 for d in rec[2] if d.is_floating_point]
    name = op_name(func)
    fused = name in FUSED_ON_CUDA or any(_FUSED.search(rec[0]) for rec in on)
    if not order:
        return "native"
    to = {order[0]} if name in autocast_ops(device) else set(order)
    rule = "fp32" if to <= {torch.float32, torch.float64} else "low" if to == {dtype} else "mixed"
    return "fused" if fused and rule == "low" else rule


FUSED_ON_CUDA = frozenset({"scaled_dot_product_attention"})
"""Ops that CUDA runs in a fused kernel of its own (flash / memory-efficient attention) where a fake CUDA call
takes the math path: their casts are emulated, their internal precision is the CPU kernel's."""


@functools.lru_cache(maxsize=2)
def autocast_ops(device: str = "cuda") -> frozenset[str]:
    """The ops with an ``AutocastCUDA`` (``AutocastCPU``) kernel in the installed torch (by name, overloads merged)."""
    regs = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA" if device == "cuda" else "AutocastCPU")
    return frozenset(r.split("::", 1)[-1].split(".", 1)[0] for r in regs)


def _fake(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        # no requires_grad: autograd's accumulator would ask for a CUDA device guard, which a CPU build lacks
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=device)
    return x


def _record(func: Callable[..., Any], args: Any, kwargs: Any, fake: Any, device: str, on: bool,
            dtype: torch.dtype) -> list[tuple[Any, ...]]:
    """The aten calls of ``func`` on fake tensors, in order (name, input dtypes, dtype arguments and output
    dtypes), with ``device``'s autocast on or off and the other's off (a fake kernel that refuses ends the list)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[tuple[Any, ...]] = []

    class _Rec(TorchDispatchMode):
        def __torch_dispatch__(self, op: Any, types: Any, a: tuple[Any, ...] = (), kw: dict[str, Any] | None = None) -> Any:
            kw = kw or {}
            leaves = pytree.tree_leaves((a, kw))
            out = op(*a, **kw)
            outs = tuple(t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            seen.append((str(op), tuple(t.dtype for t in leaves if isinstance(t, torch.Tensor)),
                         tuple(x for x in leaves if isinstance(x, torch.dtype)) + outs))
            return out

    cpu_was, cpu_dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    cuda_was, cuda_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    try:
        torch.set_autocast_enabled("cpu", on and device == "cpu")
        torch.set_autocast_enabled("cuda", on and device == "cuda")
        torch.set_autocast_dtype(device, dtype)
        with fake, _Rec():
            func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a fake kernel that refuses: the casts before it are what counts
        pass
    finally:
        torch.set_autocast_enabled("cpu", cpu_was)
        torch.set_autocast_dtype("cpu", cpu_dtype)
        torch.set_autocast_enabled("cuda", cuda_was)
        torch.set_autocast_dtype("cuda", cuda_dtype)
        torch.clear_autocast_cache()
    return seen


__all__ = ["POLICIES", "PolicyLog", "autocast_context", "cuda_policy", "op_name", "resolve", "using"]
