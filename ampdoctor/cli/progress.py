"""Progress for a stderr that is not a terminal (CI logs, ``2> file``): plain lines, at most one every
``every_s`` seconds and none for a run shorter than that, so quick runs and tests print nothing extra."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ampdoctor.input.config import STAGES

EVERY_S = 10.0


def label(stage: str) -> str:
    """'taking batches', 'stage amp', or the name as given ('FP32 steps')."""
    return "taking batches" if stage == "batches" else f"stage {stage}" if stage in STAGES else stage


class LineProgress:
    """A ``ProgressFn`` (stage, step) writing 'ampdoctor: stage amp, 1200/3000 (40 s)'."""

    def __init__(self, write: Callable[[str], None], total: int, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.write = write
        self.total = total
        self.every_s = every_s
        self.clock = clock
        self.start = self.last = clock()

    def __call__(self, stage: str, step: int) -> None:
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        self.write(f"ampdoctor: {label(stage)}, {step + 1}/{self.total} ({now - self.start:.0f} s)")


@contextlib.contextmanager
def progress_display(console: Console, total: int, quiet: bool = False) -> Iterator[Callable[[str, int], None] | None]:
    """A ``ProgressFn`` for a command: a transient bar on a terminal, throttled lines elsewhere, None when quiet."""
    if quiet:
        yield None
        return
    if not console.is_terminal:
        yield LineProgress(lambda s: console.print(s, markup=False, highlight=False, soft_wrap=True), total)
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as prog:
        task = prog.add_task("starting", total=total)

        def update(stage: str, step: int) -> None:
            prog.update(task, description=label(stage), completed=step + 1)

        yield update
