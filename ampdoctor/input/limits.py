"""Limits on loading the user's input: the host memory the cached batches may take, and how long
``build_dataloader()`` and its first batch may take. Both can be changed with environment variables."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

from ampdoctor.errors import SpecError, UsageError

CACHE_ENV = "AMPDOCTOR_BATCH_CACHE_GB"
"""Host memory (GB, 1e9 bytes) the batches of a run may take; default: half of this machine's memory."""
TIMEOUT_ENV = "AMPDOCTOR_DATA_TIMEOUT"
"""Seconds ``build_dataloader()`` and then its first batch may take each; 0 turns the limit off."""
DEFAULT_TIMEOUT_S = 600.0
FALLBACK_CACHE_BYTES = 8 * 10**9


def _env_number(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not v >= 0 or v == float("inf"):
        raise UsageError(f"{name}={raw!r}: give a non-negative number, e.g. {name}=8")
    return v


def physical_memory() -> int | None:
    """Bytes of RAM on this machine, when the OS says."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def free_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's ``MemAvailable``, or less under an address-space limit
    (``ulimit -v``, ``RLIMIT_AS``: the limit less what the process maps now); None when the OS does not say."""
    got: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    got.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm", encoding="ascii") as f:
                mapped = int(f.read().split()[0]) * (os.sysconf("SC_PAGE_SIZE") or 4096)
            got.append(max(0, soft - mapped))
    except (ImportError, OSError, ValueError, IndexError):
        pass
    if not got:
        return physical_memory()
    return min(got)


def cache_budget() -> tuple[int, str]:
    """(bytes the cached batches may take, where that number comes from)."""
    gb = _env_number(CACHE_ENV)
    if gb is not None:
        return int(gb * 1e9), f"{CACHE_ENV}={os.environ[CACHE_ENV].strip()}"
    mem = physical_memory()
    if mem is None:
        return FALLBACK_CACHE_BYTES, "the default"
    return mem // 2, "half this machine's memory"


def data_timeout() -> float | None:
    """Seconds allowed for build_dataloader() and for its first batch; None: no limit."""
    v = _env_number(TIMEOUT_ENV)
    if v is None:
        return DEFAULT_TIMEOUT_S
    return v if v > 0 else None


def human_bytes(n: float) -> str:
    """1.5 kB, 7.7 GB (powers of 1000, like the GB of the environment variable)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


class _Expired(BaseException):
    """Raised by the alarm inside user code; a BaseException so that `except Exception` there cannot swallow it."""


@contextlib.contextmanager
def deadline(seconds: float | None, what: str) -> Iterator[None]:
    """Raise SpecError if the block runs longer than ``seconds``.

    Uses SIGALRM, so it applies in the main thread on Unix only (elsewhere the block runs unlimited);
    an alarm set by someone else (pytest-timeout, say) is put back afterwards.
    """
    if (seconds is None or not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise _Expired()

    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, expire)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Expired:
        raise SpecError(
            f"{what} has not finished after {seconds:g} s; check it (a download, a hung DataLoader worker, a slow "
            f"network file system) or allow more time with {TIMEOUT_ENV}=<seconds> (0: no limit)"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 1e-3), old_interval)
