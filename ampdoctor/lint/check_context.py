"""What a lint check reads and yields: ``Ctx`` (one file's facts and, computed once, the events of each of its
functions), a ``Hit`` (the node and its message), and FP16's limits the checks compare constants with."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cached_property

from ampdoctor.lint.events import Event, Events
from ampdoctor.lint.flow import FileFacts

FP16_MAX = 65504.0


FP16_TINY = 2.0**-24
"""FP16's smallest subnormal (5.96e-8): a smaller constant rounds to 0."""


Hit = tuple[ast.AST, str]


class Ctx:
    """One file's facts and, computed once, the events of each of its functions."""

    def __init__(self, facts: FileFacts) -> None:
        self.f = facts

    @cached_property
    def events(self) -> list[Events]:
        maybe = self.f.may_step()  # (a function that cannot reach a step has no event any rule reads)
        return [Events(self.f, fn) for fn in [self.f.module, *self.f.funcs] if id(fn) in maybe]

    def scope_events(self) -> Iterator[list[Event]]:
        for ev in self.events:
            if ev.items:
                yield ev.items


def _short(node: ast.AST | None, default: str = "...") -> str:
    if node is None:
        return default
    try:
        text = ast.unparse(node)
    except Exception:  # pragma: no cover - unparse handles every node the parser makes
        return default
    return text if len(text) <= 28 else default
