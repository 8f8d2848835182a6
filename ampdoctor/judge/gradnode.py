"""Find the autograd node whose output gradient is first non-finite in one replayed backward.

Module hooks say which module's gradient went non-finite; they cannot say which operation inside it
did. Autograd can: every node of the graph takes the gradients of its forward outputs and makes the
gradients of its forward inputs, and ``torch.autograd.graph.Node.register_hook`` sees both after the
node ran, in the order backward runs them. The first node whose incoming gradients are all finite and
whose outgoing gradients are not is where the gradient broke (``SoftmaxBackward0``, ``ToCopyBackward0``:
a cast to FP16 that overflowed). A node whose incoming gradient is already non-finite while every node
before it made finite gradients received a sum: a tensor read by several ops, whose finite gradients
added up beyond the format (``summed``).

Which forward op made each node, and from which line, is recorded during the replayed forward by a
``TorchFunctionMode``: each op's output ``grad_fn``, and the nodes behind it that no earlier op made
(a composite op's inner nodes, autocast's casts), belong to that op. Unlike ``torch.autograd.detect_anomaly``
this checks Inf as well as NaN, needs no anomaly mode (no traceback kept per node), names the op's own line
rather than a line of the forward that only shares its stack, and reads a DTensor's local shard (no collective).
Used once, at diagnosis time, never in the training loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ampdoctor.judge.opscan import _SKIP, _user_line
from ampdoctor.records import MODEL
from ampdoctor.tensors import iter_tensors


@dataclass
class GradNode:
    """The first autograd node of a backward whose output gradient is non-finite."""

    node: str
    """The node's class name: 'SoftmaxBackward0', 'MulBackward0', 'ToCopyBackward0' (a dtype cast)."""
    op: str | None
    """The forward op that made it ('softmax', 'matmul', 'linear'); None when no recorded op did."""
    module: str | None
    """Innermost module running that op: '<model>' for the root's own code, None outside the model (the loss)."""
    line: str | None
    """'file.py:42' of the user's code that called the op."""
    summed: bool = False
    """Every node before it made finite gradients: its incoming gradient is a sum of finite ones (a tensor that
    several ops read) that left the format."""
    nan: bool = False
    """The first non-finite value it made is NaN (not +-Inf)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (no collective); any other tensor as it is."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _state(grads: tuple[Any, ...]) -> str:
    """'finite', 'nan' or 'inf' over the floating tensors of ``grads`` (None entries skipped)."""
    out = "finite"
    for g in grads:
        if not isinstance(g, torch.Tensor) or not g.is_floating_point() or g.numel() == 0:
            continue
        t = _local(g).detach()
        if bool(torch.isnan(t).any()):
            return "nan"
        if not bool(torch.isfinite(t).all()):
            out = "inf"
    return out


class _Origins(TorchFunctionMode):
    """Forward: which op (and module, line) made each autograd node."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.made: dict[Any, tuple[str, str | None, str | None]] = {}

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        if name in _SKIP:
            return out
        with torch._C.DisableTorchFunction():
            fns = [t.grad_fn for t in iter_tensors(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            fresh = [f for f in fns if f not in self.made]
            if fresh:
                op = name[2:-2] if name.startswith("__") and name.endswith("__") else name
                self._claim(fresh, (op, self.stack[-1] if self.stack else None, _user_line()))
        return out

    def _claim(self, todo: list[Any], where: tuple[str, str | None, str | None]) -> None:
        """``where`` made these nodes and the nodes behind them that no earlier op made."""
        while todo:
            n = todo.pop()
            if n in self.made or type(n).__name__ == "AccumulateGrad":
                continue
            self.made[n] = where
            todo.extend(nx for nx, _ in n.next_functions if nx is not None)


def _graph(root: Any) -> list[Any]:
    """Every node reachable from ``root`` (AccumulateGrad included)."""
    seen: dict[Any, None] = {}
    todo = [root]
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen[n] = None
        todo.extend(nx for nx, _ in n.next_functions)
    return list(seen)


class _Watch:
    """Backward: the first node that made a non-finite gradient, or received one no node made."""

    def __init__(self, made: dict[Any, tuple[str, str | None, str | None]]) -> None:
        self.made = made
        self.found: GradNode | None = None

    def hook(self, node: Any) -> Callable[[tuple[Any, ...], tuple[Any, ...]], None]:
        def seen(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if self.found is not None:
                return
            incoming = _state(grad_outputs)
            made = _state(grad_inputs) if incoming == "finite" else incoming
            if made == "finite":
                return
            op, module, line = self.made.get(node, (None, None, None))
            self.found = GradNode(type(node).__name__, op, module, line, summed=incoming != "finite", nan=made == "nan")
        return seen


def first_nonfinite_grad(model: nn.Module, run: Callable[[], torch.Tensor], scale: float = 1.0) -> GradNode | None:
    """Run ``run()`` (the forward and loss of ``model`` in the precision under test, returning the loss), then
    ``(loss * scale).backward()`` (``scale``: the GradScaler scale the step ran at), and return the first autograd
    node whose output gradient is non-finite, with the forward op, module and line that made it. None when the loss
    is not finite (a forward fault: no backward to blame), the replay raises, or every gradient stays finite.
    The gradients it leaves are cleared."""
    stack: list[str] = []
    names = {m: n or MODEL for n, m in model.named_modules()}
    handles: list[Any] = []

    def leave(*_: Any) -> None:  # a forward hook must return None, or it replaces the output
        if stack:
            stack.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(lambda *_a, _n=names[m]: stack.append(_n)))
        handles.append(m.register_forward_hook(leave))
    origins = _Origins(stack)
    watch = _Watch(origins.made)
    try:
        with origins:
            loss = run()
        for h in handles:
            h.remove()
        handles.clear()
        if loss.grad_fn is None or not bool(torch.isfinite(_local(loss.detach())).all()):
            return None
        for n in _graph(loss.grad_fn):
            handles.append(n.register_hook(watch.hook(n)))
        (loss.float() * scale).backward()
    except Exception:
        return None
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return watch.found
