"""Take the spec's batches: build_dataloader() and its first batch under a time limit, the rest into a
host cache bounded in bytes, with progress. Every failure is a SpecError of one line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ampdoctor.errors import SpecError
from ampdoctor.input.batches import BatchError, Batches, LoaderError, materialise
from ampdoctor.input.limits import cache_budget, data_timeout, deadline
from ampdoctor.input.spec import Spec, call_user, exited, where

ProgressFn = Callable[[str, int], None]


def load_batches(spec: Spec, steps: int, progress: ProgressFn | None = None) -> Batches:
    """``steps`` batches (fewer when the loader is shorter: they are cycled), in the loader's order."""
    timeout = data_timeout()
    budget, source = cache_budget()
    with deadline(timeout, f"{spec.path.name}: build_dataloader()"):
        loader = call_user(spec.build_dataloader, what="build_dataloader()", path=spec.path)

    def first(it: Iterator[Any]) -> Any:
        with deadline(timeout, f"{spec.path.name}: the first batch of build_dataloader()"):
            return next(it)

    def taken(n: int) -> None:
        if progress is not None:
            progress("batches", n - 1)

    try:
        return materialise(loader, steps, max_bytes=budget, budget_source=source, first_batch=first,
                           progress=taken if progress is not None else None)
    except LoaderError as e:
        raise SpecError(f"{where(e.original, spec.path)}: {e}; fix the dataloader (or skip bad records in it)") from None
    except BatchError as e:
        raise SpecError(f"{spec.path.name}: {e}") from None
    except SystemExit as e:
        raise exited(e, spec.path, "the dataloader", " while yielding a batch; ampdoctor iterates it itself, so end the "
                     "iteration (return) or raise instead of exiting") from None
