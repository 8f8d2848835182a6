"""How the watch sees a user's model through what wraps, compiles and shards it: the module a wrapper runs
(``unwrap``: ``torch.compile``'s ``_orig_mod``, DDP's ``module``), the user's own names for its parameters and
modules (``user_name``: no engine's wrapper part), this process's part of a tensor (``local``: a DTensor's local
shard, no collective), and whether a module is compiled (``is_compiled``)."""

from __future__ import annotations

import torch
from torch import nn

_WRAPPERS = ("DistributedDataParallel", "DataParallel")


def unwrap(model: nn.Module) -> nn.Module:
    """The module a wrapper runs: a ``torch.compile``d model's ``_orig_mod``, a ``DistributedDataParallel``
    or ``DataParallel``'s ``module`` (in any nesting), else the model itself. Names are the inner
    module's, so a rank's log and capture read like a single-process run."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module) and type(model).__name__ in _WRAPPERS:
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


ENGINE_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Name parts the engines insert between the user's modules (FSDP1's wrapper, activation checkpointing's, a
compiled submodule's): never the user's own names."""


def user_name(name: str) -> str:
    """A parameter or module name as the user wrote the model: ``_fsdp_wrapped_module.embed._fsdp_wrapped_module.weight``
    → ``embed.weight`` (see ``ENGINE_PARTS``; a wrapper's leading ``module.`` is dropped by ``unwrap``)."""
    if "_" not in name:
        return name
    return ".".join(p for p in name.split(".") if p not in ENGINE_PARTS)


def named_parameters(root: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``root.named_parameters()`` under the user's names (``user_name``)."""
    return [(user_name(n), p) for n, p in root.named_parameters()]


def named_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``root.named_modules()`` under the user's names: an engine's wrapper and the module it wraps share one."""
    return [(user_name(n), m) for n, m in root.named_modules()]


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard (FSDP2, tensor parallelism; no collective),
    else the tensor itself (FSDP1's parameters already are the local shard)."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and type(t).__name__ == "DTensor" else t


def is_compiled(model: nn.Module) -> bool:
    """Whether a ``torch.compile``d module is anywhere in the wrapping (DDP around compiled, or the reverse)."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            return True
        inner = getattr(model, "module", None) if type(model).__name__ in _WRAPPERS else None
        if not isinstance(inner, nn.Module):
            return False
        model = inner
