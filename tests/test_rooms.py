"""The house's rooms (issue 37): no import cycle anywhere in the package; the parallel engines found one per module
behind one protocol; the capture's own list of replayable precisions equal to the engine's."""

from __future__ import annotations

import sys
from pathlib import Path

import grimp
import pytest
from torch import nn

from ampdoctor.parallel import registry
from ampdoctor.parallel.protocol import Engine, Reader


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every set of modules that import each other in a circle (strongly connected components of two or more, or a
    module importing itself), function-level imports included, ``TYPE_CHECKING`` imports not (they run nowhere)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(adj) + 100))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in adj.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in adj.get(v, []):
                out.append(sorted(comp))

    try:
        for m in adj:
            if m not in index:
                visit(m)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_the_package_has_no_import_cycle() -> None:
    graph = grimp.build_graph("ampdoctor", cache_dir=None, exclude_type_checking_imports=True)
    assert "ampdoctor.capture.read" in graph.modules and "ampdoctor.parallel.pieces" in graph.modules
    assert graph.direct_import_exists(importer="ampdoctor.capture.read", imported="ampdoctor.capture.reassemble")
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import() -> None:
    g = grimp.ImportGraph()
    for m in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"):
        g.add_module(m)
    g.add_import(importer="pkg.a", imported="pkg.b")
    g.add_import(importer="pkg.b", imported="pkg.c")
    g.add_import(importer="pkg.c", imported="pkg.a")  # (a function-level import is an edge like any other)
    g.add_import(importer="pkg.d", imported="pkg.a")
    assert import_cycles(g) == [["pkg.a", "pkg.b", "pkg.c"]]
    g.remove_import(importer="pkg.c", imported="pkg.a")
    assert import_cycles(g) == []


def test_every_engine_module_is_found_and_implements_the_protocol() -> None:
    found = registry.engines()
    assert [e.name for e in found] == ["deepspeed", "fsdp1", "fsdp2_tp", "hsdp", "fsdp2", "tensor_parallel", "ddp"]  # by priority
    assert len({e.priority for e in found}) == len(found)
    for e in found:
        assert isinstance(e, Engine), e.name
        assert registry.named(e.name) is e
        assert isinstance(e.read(nn.Linear(2, 2), [], 0, 2), Reader)
    assert registry.named("pipeline") is None


ONE_MODULE = '''
from torch import nn

from ampdoctor.parallel import ddp


class Pipeline(ddp.Ddp):
    name = "pipeline_test"
    label = "a pipeline (a test's engine)"
    sharded = True
    priority = 99

    def holds(self, model: nn.Module) -> bool:
        return type(model).__name__ == "Stage"


ENGINE = Pipeline()
'''


def test_adding_an_engine_is_adding_one_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ampdoctor.parallel as pkg

    (tmp_path / "pipeline_test.py").write_text(ONE_MODULE)
    monkeypatch.setattr(pkg, "__path__", [*pkg.__path__, str(tmp_path)])
    registry.engines.cache_clear()
    try:
        found = registry.engines()
        assert found[0].name == "pipeline_test" and isinstance(found[0], Engine)  # the highest priority asks first

        class Stage(nn.Linear):
            pass

        assert registry.sharded_engine(Stage(2, 2)) == "pipeline_test"
        assert registry.sharded_engine(nn.Linear(2, 2)) is None
        assert registry.named("pipeline_test") is found[0]
    finally:
        monkeypatch.undo()
        registry.engines.cache_clear()
        sys.modules.pop("ampdoctor.parallel.pipeline_test", None)
    assert registry.named("pipeline_test") is None


def test_a_plain_model_has_no_engine_and_a_replica_counts_once() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    assert registry.engine_of(model) is None and registry.sharded_engine(model) is None
    w = model[0].weight
    for name in ("fsdp2", "tensor_parallel", "ddp"):
        eng = registry.named(name)
        assert eng is not None
        counted = [eng.read(model, list(model.parameters()), r, 4).counts(w) for r in range(4)]
        assert counted == [True, False, False, False], name  # a whole tensor is a replica: rank 0 counts it
        assert eng.read(model, [], 1, 4).piece(w) == {"shape": [2, 3], "offset": [0, 0]}


def test_engines_that_record_no_layout_refuse_a_rebuild_in_one_line() -> None:
    from ampdoctor.errors import CaptureError

    for name in ("ddp", "deepspeed"):
        eng = registry.named(name)
        assert eng is not None and eng.recipe(nn.Linear(2, 2)) is None
        why = eng.refusal({"engine": name, "mesh": [2]})
        assert why and "\n" not in why
        with pytest.raises(CaptureError, match="cannot be rebuilt"):
            eng.rebuild(nn.Linear(2, 2), {"engine": name, "mesh": [2]}, None, True)


