"""A run's identity in its captures: every rank of one run writes the same ``run_id``, and the model's fingerprint.

Under ``torch.distributed`` the ranks agree on the id through the process group's own key-value store
(``compare_set``: the first rank to ask sets it, every rank reads that one back). That is no collective: no rank
waits for another, and a rank that never asks holds nobody up. One process alone draws its own. A capture then says
which run and which model it belongs to, and the reader (``capture.reassemble``) refuses to put together the
shards of two runs.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from torch import nn

from ampdoctor.watch.model_view import unwrap, user_name

KEY = "ampdoctor/run_id"


def run_id() -> str | None:
    """This run's id (16 hex digits): the same on every rank of a process group; None when the group's store
    cannot be asked (the capture then says nothing of its run, and is read as an older one)."""
    own = uuid.uuid4().hex[:16]
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return own
        from torch.distributed import distributed_c10d

        got = distributed_c10d._get_default_store().compare_set(KEY, "", own)
        text = got.decode("ascii", "replace") if isinstance(got, bytes) else str(got)
        return text if text else None
    except Exception:  # no store, or one that cannot compare: the id is unknown, never a rank's own
        return None


def fingerprint(model: nn.Module, layout: dict[str, Any] | None = None) -> str:
    """16 hex digits of the model's class and of each state tensor's name and whole shape (``layout``: a sharded
    model's, where the shapes are the whole tensors'): the same on every rank of one model."""
    inner = unwrap(model)
    if layout:
        shapes = sorted((str(n), [int(x) for x in lay.get("shape", [])]) for n, lay in layout.items())
    else:
        shapes = sorted((user_name(n), [int(x) for x in t.shape])
                        for n, t in [*inner.named_parameters(), *inner.named_buffers()])
    text = f"{type(inner).__module__}.{type(inner).__qualname__}|{shapes}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


__all__ = ["fingerprint", "run_id"]
