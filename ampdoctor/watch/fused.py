"""One-pass statistics on the CPU: a small C++ kernel, compiled in the background, eager until then.

``tensor_stats`` in eager PyTorch makes about a dozen elementwise passes (the cast, comparisons,
a bincount, segment max/min), each with a temporary. This kernel reads every element once and
keeps, per tensor, the eight category counts, the largest finite |x| and the smallest non-zero
finite |x|: the same row, from the same exact rule (the category is read from the float32 bit
pattern of |x| against the bit patterns of the format's thresholds, as ``stats._thresholds``
derives them; NaN is every pattern above +inf's). FP16 and BF16 elements are widened to float32
exactly first. Work is split into chunks of ``CHUNK`` elements across all tensors and run on
torch's intra-op threads; the tensors are read in place (no concatenation).

It is built from ``csrc/fused.cpp`` with ``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed) by
a separate process the first time a ``Monitor`` starts (about 36 s of one core on the development
machine), and cached by torch in ``~/.cache/torch_extensions`` for every later process, which
imports the finished build directly. No step ever waits for the compiler: steps taken before it is
ready use the eager path, which gives the same rows (tested on random bit patterns). Without a
compiler, or with ``AMPDOCTOR_FUSED=0``, the eager path is all there is. CUDA tensors always take
the eager path.

The same build holds two more things the monitor uses on every step: ``norms`` (each gradient's L2
norm in one call, squares summed in double) and ``Tap``, the C++ side of ``watch.hooks``: per-step
tensor ids, module calls, gradient hooks that call no Python, and the rows of CPU tensors made as
each tensor appears (still in cache, and nothing held until the step ends).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ampdoctor")

CHUNK = 1 << 16

SOURCE = Path(__file__).with_name("csrc") / "fused.cpp"
"""The kernel's C++ (shipped as package data: the wheel, the sdist and an editable install carry it)."""


def _cpu_tag() -> str | None:
    """A hash of this CPU's instruction-set flags (Linux), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha1(line.encode()).hexdigest()[:8]
    except OSError:
        pass
    return None


_CPU = _cpu_tag()
CFLAGS = ["-O3", "-fno-math-errno"] + (["-march=native"] if _CPU is not None else [])
"""``-fno-math-errno``: ``sqrt`` need not set errno, so its loops vectorise (its results are the same IEEE roots).
``-march=native`` (AVX2 and wider where the CPU has them) only where the build name can carry the
CPU's flags: a cache shared by machines with other CPUs (a cluster's home directory) then holds one
build per kind of CPU, and none runs an instruction its CPU lacks."""
NAME = "ampdoctor_stats_" + hashlib.sha1(
    (SOURCE.read_text(encoding="utf-8") + " ".join(CFLAGS) + (_CPU or "") + torch.__version__).encode()).hexdigest()[:12]
"""The build's name carries the hash of the source, the flags, the CPU and torch's version: a changed
kernel, another CPU or another torch (whose C++ ABI the build links against) is a new build, never a
stale import."""
_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "proc": None, "failed": False}
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def enabled() -> bool:
    return os.environ.get("AMPDOCTOR_FUSED", "1") not in ("0", "false", "no", "off")


def build_dir() -> Path:
    """Where torch builds and caches the kernel (``TORCH_EXTENSIONS_DIR`` moves it)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(NAME, False))
    except Exception:  # a torch without the private helper, or a folder it could not make (read-only, full)
        from torch.utils.cpp_extension import get_default_build_root

        return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / NAME


def build_now() -> Any:
    """Build (or load the cached build of) the kernel in this process, blocking; None without a compiler."""
    try:
        from torch.utils.cpp_extension import load

        mod = load(NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS, verbose=False, with_cuda=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache: the eager path stays
        _state["failed"] = True
        _state["error"] = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        log.info("ampdoctor: the fused statistics kernel is not available (%s); using the eager path", e)
        return None
    _state["module"] = mod
    return mod


MIN_FREE_BYTES = 20 * 10**6
"""The free space below which a build is not tried: the finished build is 1.3 MB (``du -sh`` of its folder, on the
development machine), its objects about as much again."""


def obstacle() -> str | None:
    """What stops a build before the compiler runs, in words: the build folder (``TORCH_EXTENSIONS_DIR``, else
    torch's cache) read-only or not a folder, its disk full, no C++ compiler or no ninja; None when nothing does."""
    import errno
    import shutil
    import tempfile

    folder = build_dir()
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    env = " (TORCH_EXTENSIONS_DIR)" if os.environ.get("TORCH_EXTENSIONS_DIR") else ""
    move = "set TORCH_EXTENSIONS_DIR to a writable folder on a disk with space"
    if not probe.is_dir():
        return f"{probe}, on the way to the build folder{env}, is not a folder; {move}"
    try:
        with tempfile.TemporaryFile(dir=probe) as f:  # the real test: root ignores permissions, not a read-only mount
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"the disk holding the build folder {probe}{env} is full; free some space or {move}"
        how = "read-only file system" if e.errno == errno.EROFS else f"{e.strerror}, mode {oct(probe.stat().st_mode & 0o777)}"
        return f"the build folder {probe}{env} cannot be written ({how}); {move}"
    free = shutil.disk_usage(probe).free
    if free < MIN_FREE_BYTES:
        return f"the disk holding the build folder {probe}{env} has {free // 1000} kB free; free some space or {move}"
    from torch.utils.cpp_extension import is_ninja_available

    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++", "clang++")):
        return "no C++ compiler on PATH (install g++ or clang, or set CXX)"
    if not is_ninja_available():
        return "no ninja on PATH (pip install ninja)"
    return None


def why_not() -> str:
    """Why the kernel is not built, in words: ``obstacle``, else the build's own last line."""
    return obstacle() or (f"the build failed: {_state['error']}" if _state.get("error") else
                          "the build failed (`ampdoctor build-kernel` shows why)")


def _say_failed() -> None:
    """Once per process (the first local rank only under torchrun): the kernel cannot be built, why, and what the
    Monitor runs instead."""
    if _state.get("said") or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    _state["said"] = True
    from ampdoctor.notify import say

    say("ampdoctor: the statistics kernel could not be built (%s); the Monitor goes on with PyTorch's eager "
        "statistics: the same figures, slower on recorded steps", why_not())


def _load_built() -> Any:
    """Import the cached build directly (milliseconds; no compiler involved), or None if there is none."""
    so = build_dir() / f"{NAME}.so"
    if not so.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(NAME, so)
        if spec is None or spec.loader is None:
            return None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as e:  # a stale or foreign build: leave it to the builder
        log.info("ampdoctor: could not load %s (%s)", so, e)
        return None
    _state["module"] = mod
    return mod


BUSY = 3
"""The builder's exit status when another process on the machine holds the build lock (it builds; we wait)."""
POLL_S = 5.0
"""How often a process whose kernel another process builds looks for the finished build (one stat)."""


def lock_path() -> Path:
    """The machine's build lock (beside torch's build folder): the one process holding it builds."""
    return build_dir().parent / f"{NAME}.ampdoctor.lock"


def _file_lock() -> Any:
    from filelock import FileLock

    p = lock_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(p))


def _building_elsewhere() -> bool:
    """Whether another process holds the build lock now (under torchrun: another rank's builder)."""
    from filelock import Timeout

    try:
        lk = _file_lock()
        lk.acquire(timeout=0)
    except Timeout:
        return True
    except OSError:  # a read-only cache: the builder will say so
        return False
    lk.release()
    return False


def start_build() -> None:
    """Start building the kernel in a separate process, if it is not built and no other process on this machine
    is building it (the build lock: under torchrun one rank's builder builds, the other ranks look for the
    finished build now and then, and every rank keeps training meanwhile, steps on the cheap path). The build
    finishes, and releases the locks, even if this process ends first. The Monitor calls it; one-off commands
    do not (they use a finished build; ``ampdoctor build-kernel`` builds one ahead)."""
    if not enabled() or _state["module"] is not None or _state["failed"] or _state["proc"] is not None:
        return
    with _lock:
        if _state["proc"] is not None or _load_built() is not None:
            return
        if _building_elsewhere():
            _state["proc"] = "elsewhere"
            _state["next_look"] = time.monotonic() + POLL_S
            return
        try:
            why = obstacle()
        except Exception:  # (the look is a courtesy: the builder still finds out)
            why = None
        if why is not None:  # the folder, its disk or the tools: no builder would get anywhere; said now, once
            _state["failed"] = True
            _say_failed()
            return
        try:
            _state["proc"] = subprocess.Popen([sys.executable, "-m", "ampdoctor.watch.fused"], stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              start_new_session=True)
        except OSError as e:  # pragma: no cover
            _state["failed"] = True
            _state["error"] = f"could not start the build ({e})"
            _say_failed()


def pending() -> bool:
    """Whether a build is under way (here or in another process) that this process may still load: the Monitor
    keeps its cheap path until it is ready."""
    return enabled() and kernel() is None and not _state["failed"] and _state["proc"] not in (None, False)


def kernel() -> Any:
    """The kernel module if it is built and loaded (loading a finished build on first ask), else None."""
    if not enabled():
        return None
    mod = _state["module"]
    if mod is not None or _state["failed"]:
        return mod
    proc = _state["proc"]
    if proc == "elsewhere":
        now = time.monotonic()
        if now < _state.get("next_look", 0.0):
            return None
        _state["next_look"] = now + POLL_S
        mod = _load_built()
        if mod is None and not _building_elsewhere():  # the other builder is done and left nothing: build here
            _state["proc"] = None
            start_build()
        return mod
    if proc is not None and proc is not False:
        code = proc.poll()
        if code is None:
            return None  # still building
        _state["proc"] = False  # done (or failed): load once
        mod = _load_built()
        if mod is None and code == BUSY:  # another process took the lock first: it builds, we look later
            _state["proc"] = "elsewhere"
            _state["next_look"] = time.monotonic() + POLL_S
            return None
        if mod is None:
            _state["failed"] = True
            _say_failed()
        return mod
    if _state.get("looked"):
        return None
    _state["looked"] = True  # one look for a finished build per process, then only after start_build
    return _load_built()


def fused_stats(tensors: list[torch.Tensor], uf: int, sub: int, of: int) -> torch.Tensor | None:
    """Rows for CPU tensors of float32/float16/bfloat16 in one pass, or None when the kernel is not ready
    (or a tensor is elsewhere): the caller takes the eager path."""
    mod = kernel()
    if mod is None:
        return None
    with torch.no_grad():
        rows = mod.stats(tensors, uf, sub, of, CHUNK)  # reads data only; None for a tensor elsewhere or of another dtype
    return rows  # type: ignore[no-any-return]


def fused_stats_norms(tensors: list[torch.Tensor], uf: int, sub: int, of: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fused_stats`` and ``fused_norms`` of the same CPU tensors in one read of them (the rows, then the float32
    norms: the very values each call gives alone), or None when the kernel is not ready or a tensor is elsewhere."""
    mod = kernel()
    if mod is None or not hasattr(mod, "stats_norms"):
        return None
    with torch.no_grad():
        out = mod.stats_norms(tensors, uf, sub, of, CHUNK)
    return (out[0], out[1]) if len(out) == 2 else None


def fused_norms(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm of each CPU tensor (float32, 1-D) in one call, or None when the kernel is not ready (or a
    tensor is elsewhere): the caller takes ``torch._foreach_norm``."""
    mod = kernel()
    if mod is None:
        return None
    with torch.no_grad():
        return mod.norms(tensors, CHUNK)  # type: ignore[no-any-return]


def fused_adam(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], eps: list[float]) -> torch.Tensor | None:
    """Per Adam state tensor, the norm of ``m / (sqrt(v) + eps)`` and the smallest ``v`` (float64 ``[2n]``: the norms,
    then the minima) in one pass over each, or None when the kernel is not ready or a tensor is not float32 on the
    CPU: the caller takes the torch path (``engine.ring.adam_figures``)."""
    mod = kernel()
    if mod is None or not hasattr(mod, "adam_figures"):
        return None
    with torch.no_grad():
        out = mod.adam_figures(exp_avg, exp_avg_sq, eps)
    return out if out is not None and out.numel() == 2 * len(exp_avg) else None


__all__ = ["CHUNK", "build_dir", "build_locked", "build_now", "enabled", "fused_adam", "fused_norms", "fused_stats", "fused_stats_norms", "kernel",
           "pending", "start_build"]


def build_locked(wait: bool = False) -> int:
    """Build the kernel holding the machine's build lock: 0 built (or already there), 1 failed (no compiler),
    ``BUSY`` another process holds the lock and builds it (``wait``: wait for it, then load its build)."""
    from filelock import Timeout

    try:
        lk = _file_lock()
        lk.acquire(timeout=-1 if wait else 0)
    except Timeout:
        return BUSY
    except OSError:
        lk = None
    try:
        return 0 if (_load_built() is not None or build_now() is not None) else 1
    finally:
        if lk is not None:
            lk.release()


if __name__ == "__main__":  # the background build started by start_build(), or a build ahead of the first Monitor
    sys.exit(build_locked())
