"""Restore the RNG states a capture (``rng.pt``) or a checkpoint (a Trainer's ``rng_state.pth``, a dict's
``rng_state``) holds, so a replayed step that draws randomness (dropout, a diffusion timestep, noise drawn
in the step) draws what the run drew."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

ALIASES = {"torch": "torch", "cpu": "torch", "cuda": "cuda", "numpy": "numpy", "python": "python"}


def _np_state(v: Any) -> tuple[Any, ...] | None:
    if isinstance(v, Mapping) and "keys" in v:  # a capture's: tensors and plain values
        keys = v["keys"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        return (str(v.get("kind", "MT19937")), keys.astype(np.uint32), int(v.get("pos", 0)),
                int(v.get("has_gauss", 0)), float(v.get("cached_gaussian", 0.0)))
    if isinstance(v, (tuple, list)) and len(v) == 5:  # np.random.get_state() as the Trainer saves it
        return (str(v[0]), np.asarray(v[1]).astype(np.uint32), int(v[2]), int(v[3]), float(v[4]))
    return None


def _py_state(v: Any) -> tuple[Any, ...] | None:
    if isinstance(v, Mapping) and "state" in v:
        st = v["state"]
        st = st.tolist() if isinstance(st, torch.Tensor) else list(st)
        return (int(v.get("version", 3)), tuple(int(x) for x in st), v.get("gauss"))
    if isinstance(v, (tuple, list)) and len(v) == 3:  # random.getstate()
        return (int(v[0]), tuple(int(x) for x in v[1]), v[2])
    return None


def restore(states: Mapping[str, Any] | None) -> list[str]:
    """Set every RNG state ``states`` holds that this process has; the names set (``torch``, ``cuda``,
    ``numpy``, ``python``). A state that does not fit is left alone (not named)."""
    if not states:
        return []
    done: list[str] = []
    for key, v in states.items():
        kind = ALIASES.get(str(key))
        try:
            if kind == "torch" and isinstance(v, torch.Tensor):
                torch.set_rng_state(v.to(torch.uint8).cpu())
            elif kind == "cuda":
                if not torch.cuda.is_available():
                    continue
                tensors = v if isinstance(v, (list, tuple)) else [v]
                torch.cuda.set_rng_state_all([t.to(torch.uint8).cpu() for t in tensors][: torch.cuda.device_count()])
            elif kind == "numpy":
                ns = _np_state(v)
                if ns is None:
                    continue
                np.random.set_state(ns)
            elif kind == "python":
                ps = _py_state(v)
                if ps is None:
                    continue
                random.setstate(ps)
            else:
                continue
        except Exception:  # a state of another torch or numpy build: the replay is seeded instead
            continue
        done.append(kind)
    return sorted(set(done), key=["torch", "cuda", "numpy", "python"].index)
