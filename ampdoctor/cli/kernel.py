"""`ampdoctor build-kernel`: build the one-pass statistics kernel now, ahead of the first Monitor."""

from __future__ import annotations

from ampdoctor.cli.common import boundary, fail, out
from ampdoctor.errors import UsageError


@boundary
def build_kernel() -> None:
    """Build the C++ statistics kernel now, ahead of the first Monitor.

    Once per machine, CPU and torch version, so that the first Monitor starts on it instead of on the cheap path it keeps while a background build runs. Waits for a build that another process on this machine has under way.
    """
    from ampdoctor.watch import fused

    if not fused.enabled():
        raise UsageError("AMPDOCTOR_FUSED=0 turns the kernel off in this environment; unset it to build the kernel")
    why = fused.obstacle()
    if why is not None:  # the folder, its permissions, the disk, the tools: said before anything is tried
        fail(f"the statistics kernel cannot be built here: {why}")
        return
    out.print("building the statistics kernel (about 45 s of one core, longer on a busy machine; once per machine)...", style="dim",
              markup=False, highlight=False)
    if fused.build_locked(wait=True) == 0:
        out.print(f"the statistics kernel is ready: {fused.build_dir()}", markup=False, highlight=False)
        return
    fail(f"the statistics kernel could not be built: {fused.why_not()}; the Monitor works without it, on the "
         "slower eager path")
