"""What this machine can run (``ampdoctor doctor``): versions, devices and the precisions they support, the
statistics kernel (looked at, never built), Triton and the framework extras. Reads; starts nothing."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
from dataclasses import dataclass

import torch

EXTRAS = (("transformers", "transformers"), ("accelerate", "transformers"), ("diffusers", "diffusers"),
          ("lightning", "lightning"), ("deepspeed", "deepspeed"), ("tensorboard", "tensorboard"))
"""(package, the ampdoctor extra that installs it)."""


@dataclass(frozen=True)
class Fact:
    """One line of the check: what, what was found, and whether it is ready (None: informative)."""

    what: str
    found: str
    ok: bool | None = None


def version_of(package: str) -> str | None:
    """The installed distribution's version, without importing it (deepspeed's import takes seconds)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def devices() -> list[Fact]:
    """The CPU and every CUDA device, with the half precisions each runs."""
    from ampdoctor.input.env import cpu_name

    cap = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    out = [Fact("cpu", f"{cpu_name()}{f' ({cap})' if cap else ''}: fp16 and bf16 autocast", True)]
    if not torch.cuda.is_available():
        why = "no CUDA device" if torch.version.cuda else "this torch is a CPU build"
        return [*out, Fact("cuda", f"none ({why}); triage runs on the CPU", None)]
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        fp16 = "fp16 (tensor cores)" if major >= 7 else "fp16" if (major, minor) >= (5, 3) else "no fp16"
        bf16 = "bf16" if major >= 8 else "bf16 emulated (slow)" if _bf16_any(i) else "no bf16"
        out.append(Fact(f"cuda:{i}", f"{torch.cuda.get_device_name(i)}, sm_{major}{minor}: {fp16}, {bf16}",
                        (major, minor) >= (5, 3)))
    return out


def _bf16_any(i: int) -> bool:
    with torch.cuda.device(i):
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=True))
        except TypeError:  # a torch before the argument
            return bool(torch.cuda.is_bf16_supported())


def kernel() -> Fact:
    """Whether the C++ statistics kernel is built for this source, CPU and torch (a file check: nothing is
    compiled or loaded), and what building it needs."""
    from ampdoctor.watch import fused

    if not fused.enabled():
        return Fact("statistics kernel", "turned off (AMPDOCTOR_FUSED=0)", None)
    if (fused.build_dir() / f"{fused.NAME}.so").exists():
        return Fact("statistics kernel", "built", True)
    compiler = next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)), None)
    ninja = shutil.which("ninja") is not None or importlib.util.find_spec("ninja") is not None
    if compiler and ninja:
        return Fact("statistics kernel", f"not built; `ampdoctor build-kernel` builds it ({compiler}, ninja)", False)
    lacks = " and ".join(x for x, have in (("a C++ compiler", compiler), ("ninja (pip install ninja)", ninja)) if not have)
    return Fact("statistics kernel", f"not built, and cannot be: needs {lacks}; the slower eager path works", False)


def triton() -> Fact:
    v = version_of("triton")
    if v is None:
        return Fact("triton", "not installed (CUDA statistics take the eager path)", None)
    return Fact("triton", v, True)


def extras() -> list[Fact]:
    out = []
    for pkg, extra in EXTRAS:
        v = version_of(pkg)
        out.append(Fact(pkg, v if v is not None else f"not installed (pip install 'ampdoctor[{extra}]')",
                        True if v is not None else None))
    return out


def facts() -> list[Fact]:
    """Every line of ``ampdoctor doctor``, in order."""
    from ampdoctor._version import __version__

    cuda = torch.version.cuda
    cudnn = torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None
    return [
        Fact("ampdoctor", __version__),
        Fact("python", platform.python_version()),
        Fact("torch", torch.__version__),
        Fact("CUDA", f"{cuda}{f', cuDNN {cudnn}' if cudnn else ''}" if cuda else "none (CPU build of torch)"),
        *devices(),
        kernel(),
        triton(),
        *extras(),
    ]


__all__ = ["EXTRAS", "Fact", "devices", "extras", "facts", "kernel", "triton", "version_of"]
