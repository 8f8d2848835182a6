"""Walk the tensors inside the nested outputs models return."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def iter_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside a tensor, tuple/list, dict or ModelOutput-like object (depth-limited)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 4:
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v, depth + 1)
    elif hasattr(obj, "to_tuple"):  # transformers ModelOutput that is not a dict
        yield from iter_tensors(obj.to_tuple(), depth + 1)

