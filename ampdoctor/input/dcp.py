"""Read a torch.distributed.checkpoint folder (``dcp.save`` of an FSDP2 run's ``get_state_dict``) on one process,
without running code from it.

torch's own reader unpickles ``.metadata`` with ``pickle.load`` and every non-tensor item with
``torch.load(weights_only=False)``. Here ``.metadata`` is unpickled with an allow-list (torch.distributed.checkpoint's
metadata classes, dtypes, ``torch.Size``, paths) and non-tensor items with ``torch.load(weights_only=True)``; the
tensors are read by torch's reader (``weights_only=True`` already). Anything else is refused in one line.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from ampdoctor.errors import CheckpointError
from ampdoctor.input.checkpoint import CheckpointState, _from_dict, first_line

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PurePosixPath"), ("torch.serialization", "_get_layout")}


class _MetadataUnpickler(pickle.Unpickler):
    refused: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES and not name.startswith("__") or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        self.refused.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp(path: Path) -> CheckpointState:
    """The folder's model / optimizer / scaler state as ``read_checkpoint`` returns a dict's."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.metadata import StorageMeta
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError as e:  # pragma: no cover - a torch without torch.distributed
        raise CheckpointError(f"{path}: a torch.distributed.checkpoint folder, and this torch cannot read one ({e})") from None

    refused: list[str] = []
    _MetadataUnpickler.refused = refused
    try:
        with (path / ".metadata").open("rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as e:  # read here first: torch's loader would log its own tracebacks on the way to failing
        if refused:
            raise CheckpointError(f"{path}/: its .metadata holds pickled Python objects that checking does not load "
                                  f"({', '.join(refused[:3])}); only torch.distributed.checkpoint's own metadata is read") from None
        raise CheckpointError(f"{path}/: its .metadata cannot be read ({type(e).__name__}: {first_line(e)}); the save was "
                              "probably interrupted: use an earlier checkpoint") from None

    class SafeReader(FileSystemReader):  # type: ignore[misc]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class SafePlanner(_EmptyStateDictLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element  # (torch's own helper)

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    sd: dict[str, Any] = {}
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is unavailable...": one process reads it, as intended
            _load_state_dict(sd, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=True)
    except Exception as e:
        raise CheckpointError(f"{path}/: a torch.distributed.checkpoint folder that cannot be read ({type(e).__name__}: "
                              f"{first_line(e)}); copy the whole folder (.metadata and every .distcp file)") from None
    state = _from_dict(sd, path)
    state.notes.append("a torch.distributed.checkpoint folder, read on one process")
    return state


__all__ = ["read_dcp"]
