"""`ampdoctor doctor`: what this machine can run, one fact a line."""

from __future__ import annotations

from ampdoctor.cli.common import boundary, out


@boundary
def doctor() -> None:
    """Say what this machine can run: torch, CUDA, fp16/bf16 per device, the kernel, Triton, the extras.

    Looks only: the statistics kernel is not built, no framework is imported. Exit code 0.
    """
    from ampdoctor.engine.doctor import facts

    rows = facts()
    width = max(len(f.what) for f in rows)
    for f in rows:
        mark = {True: "ok", False: "--", None: "  "}[f.ok]
        out.print(f"{mark} {f.what:<{width}}  {f.found}", markup=False, highlight=False, soft_wrap=False)
