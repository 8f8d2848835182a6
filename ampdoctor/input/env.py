"""The environment block every report carries, and device resolution."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

from ampdoctor.errors import DeviceError


def resolve_device(name: str) -> torch.device:
    """'auto' → cuda if available else cpu; check that an explicit device exists."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {name}: no CUDA device is available on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s); use cuda:0")
    elif dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {name}: only cpu and cuda are supported")
    return dev


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model, as /proc/cpuinfo's "model name" says it ("AMD EPYC 7763 64-Core Processor"); else
    what the platform says (``platform.processor()``, then the architecture)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def environment(device: torch.device, argv: list[str] | None = None) -> dict[str, Any]:
    """Versions, device, dtype support and TF32 flags, for reports."""
    from ampdoctor._version import __version__

    info: dict[str, Any] = {
        "ampdoctor": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "cuda": torch.version.cuda,
        "device": str(device),
        "command": " ".join(argv if argv is not None else ["ampdoctor", *sys.argv[1:]]),
    }
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        info.update(
            device_name=torch.cuda.get_device_name(device),
            compute_capability=f"{cap[0]}.{cap[1]}",
            fp16_supported=True,
            bf16_supported=bool(torch.cuda.is_bf16_supported()),
            tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
            tf32_cudnn=bool(torch.backends.cudnn.allow_tf32),
        )
    else:
        info.update(
            device_name=cpu_name(),
            compute_capability=None,
            fp16_supported=True,
            bf16_supported=True,
            tf32_matmul=False,
            tf32_cudnn=False,
            note="CPU autocast keeps softmax, exp, pow, layer_norm, sum and mean in FP16 where "
            "CUDA autocast runs them in FP32; a verdict can differ on a GPU.",
        )
    return info
