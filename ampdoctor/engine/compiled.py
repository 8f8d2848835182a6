"""Compile as a rung: the failing step of the compiled stage replayed eager and compiled, and for a failure that
only the compiled model has, where in the compiler it starts and the first op of the graph that differs.

From the weights before the compiled stage's first faulty step (its snapshot) and that step's batch, in the target's
precision (``ladder.compile``):

1. eager (no compile): a failure here too is not a compile problem (the verdict stays the eager one's);
2. ``torch.compile`` with ``eager`` (Dynamo's graph capture), ``aot_eager`` (+ AOT autograd) and ``inductor`` (+
   Inductor's generated code): the first backend that fails names the compiler stage where the failure starts;
3. Inductor with ``emulate_precision_casts`` (each fused intermediate rounded to the low-precision dtype as eager
   rounds it): finite there means the fusion's kept precision is the mechanism;
4. the first op: the forward graph Dynamo captures, cut after op k and compiled with the failing backend, against the
   same graph run op by op (eager); a binary search for the first k whose output differs beyond the format's rounding
   (or is non-finite where eager's is finite). Its module and source line come from the graph's own metadata.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ampdoctor.engine.forward import forward_loss
from ampdoctor.input.batches import to_device
from ampdoctor.input.spec import Spec
from ampdoctor.ladder import Rung
from ampdoctor.ladder.compile import BACKENDS, STAGE_OF, CompileTransform

ROUNDING_ULPS = 8
"""A compiled op's output differs from eager's beyond the format's rounding when some element is further apart than
this many units in the last place of the output's dtype (a fused kernel's sums may round a few times differently)."""


@dataclass
class BackendRun:
    """One replay of the failing step: its backend (None: eager PyTorch), and what went non-finite."""

    backend: str | None
    emulate_precision_casts: bool = False
    loss: float = math.nan
    bad_params: list[str] = field(default_factory=list)
    """Parameters whose gradient holds NaN/Inf."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.loss) and not self.bad_params

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend or "none", "emulate_precision_casts": self.emulate_precision_casts,
                "loss": self.loss, "bad_params": self.bad_params[:5], "error": self.error, "ok": self.ok}


@dataclass
class GraphOp:
    """The first op of a compiled forward graph whose output differs from eager's."""

    op: str
    """The op as the graph names it ('nan_to_num', 'mul', 'layer_norm')."""
    node: str
    module: str | None
    """The module running it (from the graph's ``nn_module_stack``), None for the model's own code."""
    line: str | None
    """'file.py:42' of the user's code that called it."""
    code: str | None
    eager_absmax: float
    compiled_absmax: float
    eager_nonfinite: int
    compiled_nonfinite: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class CompileBisect:
    """What the replays of the compiled stage's failing step found."""

    step: int
    runs: list[BackendRun]
    stage: str | None = None
    """Where a compile-only failure starts: graph_capture | aot_autograd | inductor_codegen (None: eager fails too,
    or no backend fails on the replay)."""
    backend: str | None = None
    emulate_fixes: bool | None = None
    op: GraphOp | None = None

    @property
    def eager_fails(self) -> bool:
        return not self.runs[0].ok

    def as_facts(self) -> dict[str, Any]:
        return {"step": self.step, "stage": self.stage, "backend": self.backend, "emulate_fixes": self.emulate_fixes,
                "eager_fails": self.eager_fails, "runs": [r.as_dict() for r in self.runs],
                "op": self.op.as_dict() if self.op is not None else None}


def replay_step(model: nn.Module, state: dict[str, torch.Tensor], spec: Spec, micro: list[Any], rung: Rung,
                device: torch.device, scale: float = 1.0) -> BackendRun:
    """Forward and backward of one step's micro-batches from ``state`` as ``rung`` computes them (its transform too),
    the loss scaled by ``scale`` as the run's GradScaler scaled it; never raises."""
    tr = rung.transform
    backend = tr.backend if isinstance(tr, CompileTransform) else None
    run = BackendRun(backend, isinstance(tr, CompileTransform) and tr.emulate_precision_casts)
    torch._dynamo.reset()
    model.load_state_dict(state)
    model.train()
    try:
        net = rung.cast_model(model, device)
        net.zero_grad(set_to_none=True)
        total = 0.0
        for b in micro:
            loss = forward_loss(net, to_device(b, device), spec.loss_fn, rung)[1] / len(micro)
            (loss.float() * scale).backward()
            total += float(loss.detach())
        run.loss = total
        run.bad_params = [n for n, p in net.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    except Exception as e:  # the user's model failing under a backend is data
        run.error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    finally:
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
    return run


def bisect(model: nn.Module, state: dict[str, torch.Tensor], spec: Spec, micro: list[Any], target: Rung,
           device: torch.device, step: int, scale: float = 1.0, find_op: bool = True) -> CompileBisect:
    """Eager, then each backend in turn, then Inductor emulating eager's casts; the first op when one backend fails."""
    from ampdoctor.ladder.compile import compiled

    def replay(r: Rung) -> BackendRun:
        return replay_step(model, state, spec, micro, r, device, scale)

    runs = [replay(target)]
    out = CompileBisect(step, runs)
    if not runs[0].ok:
        return out  # eager fails too: not a compile problem
    for backend in BACKENDS:
        runs.append(replay(compiled(target, backend)))
        if not runs[-1].ok:
            out.stage, out.backend = STAGE_OF[backend], backend
            break
    if out.backend == "inductor":
        runs.append(replay(compiled(target, "inductor", emulate_precision_casts=True)))
        out.emulate_fixes = runs[-1].ok
    if out.backend is not None and find_op:
        try:
            out.op = first_graph_op(model, state, spec, micro[0], target, device, out.backend)
        except Exception:  # the op is a detail: a graph the search cannot cut leaves it unnamed
            out.op = None
    return out


# the first op ------------------------------------------------------------------------------------------------

@dataclass
class _Graph:
    gm: fx.GraphModule
    inputs: list[Any] | None = None


def _captured_graphs(net: nn.Module, run: Callable[[nn.Module], Any]) -> list[_Graph]:
    """The FX graphs Dynamo captures from ``net``'s forward (one per graph break), with the inputs of their first call."""
    graphs: list[_Graph] = []

    def record(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        g = _Graph(gm)
        graphs.append(g)

        def call(*args: Any) -> Any:
            if g.inputs is None:
                g.inputs = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            return gm(*args)

        return call

    torch._dynamo.reset()
    net.compile(backend=record)
    with torch.no_grad():
        run(net)
    torch._dynamo.reset()
    return [g for g in graphs if g.inputs is not None]


def _ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def _eager_values(gm: fx.GraphModule, inputs: list[Any], autocast: Any) -> dict[str, Any]:
    """Every node's output, the graph run op by op as eager PyTorch runs it."""
    values: dict[str, Any] = {}

    class Keep(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.no_grad(), autocast:
        Keep(gm).run(*inputs)
    return values


def _prefix(gm: fx.GraphModule, upto: fx.Node) -> fx.GraphModule:
    """The graph cut after ``upto``: its output is that node's."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            break
        env[n] = g.node_copy(n, lambda a: env[a])
        if n is upto:
            break
    g.output(env[upto])
    g.eliminate_dead_code()
    return fx.GraphModule(gm, g)


def _differs(a: Any, b: Any) -> bool:
    """Beyond the format's rounding: a different shape, non-finite where the other is finite, or further apart than
    ``ROUNDING_ULPS`` units in the last place of the dtype."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or not a.is_floating_point():
        return False
    if a.shape != b.shape:
        return True
    fa, fb = a.detach().double(), b.detach().double()
    if bool((torch.isfinite(fa) != torch.isfinite(fb)).any()):
        return True
    both = torch.isfinite(fa) & torch.isfinite(fb)
    eps = torch.finfo(a.dtype).eps
    tiny = torch.finfo(a.dtype).tiny
    gap = (fa - fb).abs()[both]
    room = (ROUNDING_ULPS * eps * torch.maximum(fa.abs(), fb.abs()) + tiny)[both]
    return bool((gap > room).any())


def _summary(t: Any) -> tuple[float, int]:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return math.nan, 0
    f = t.detach().double()
    fin = f[torch.isfinite(f)]
    return (float(fin.abs().max()) if fin.numel() else math.nan), int((~torch.isfinite(f)).sum())


def _where(n: fx.Node) -> tuple[str | None, str | None, str | None]:
    """(module, 'file.py:42', the line's code) of a graph node, from Dynamo's metadata."""
    stack = n.meta.get("nn_module_stack") or {}
    module = None
    if stack:
        path = str(list(stack.values())[-1][0])
        module = path.removeprefix("L['self'].").removeprefix("L['self']").replace("L['fn'].", "") or None
        module = _clean_module(module)
    trace = str(n.meta.get("stack_trace") or "").strip().splitlines()
    line = code = None
    for i, text in enumerate(trace):
        s = text.strip()
        if s.startswith('File "'):
            file = s.split('"')[1]
            no = s.split("line ")[1].split(",")[0] if "line " in s else "?"
            line = f"{Path(file).name}:{no}"
            code = trace[i + 1].strip() if i + 1 < len(trace) else None
    return module, line, code


def _clean_module(path: str | None) -> str | None:
    """Dynamo's module path ("L['self'].blocks[0].attn", "self.blocks[0]") as a module name ('blocks.0.attn')."""
    if not path:
        return None
    p = path.removeprefix("self.").replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    return p.strip(".") or None


def first_graph_op(model: nn.Module, state: dict[str, torch.Tensor], spec: Spec, batch: Any, target: Rung,
                   device: torch.device, backend: str) -> GraphOp | None:
    """The first op of the forward graph whose compiled output (the graph cut after it, compiled with ``backend``)
    differs from eager's beyond the format's rounding; a binary search over the graph's ops."""
    model.load_state_dict(state)
    model.train()
    net = target.cast_model(model, device)
    if net is model:
        import copy

        net = copy.deepcopy(model)
    b = to_device(batch, device)
    graphs = _captured_graphs(net, lambda m: forward_loss(m, b, spec.loss_fn, target))
    dev = next(iter(model.parameters())).device
    for g in graphs:
        assert g.inputs is not None
        eager = _eager_values(g.gm, g.inputs, target.autocast_on(dev))
        ops = _ops(g.gm)

        def differs(k: int, g: _Graph = g, eager: dict[str, Any] = eager, ops: list[fx.Node] = ops) -> bool:
            return _differs(eager[ops[k].name], _compiled_value(g, ops[k], backend, target.autocast_on(dev)))

        if not ops or not differs(len(ops) - 1):
            continue
        lo, hi = 0, len(ops) - 1  # the first k that differs: ops[hi] does
        while lo < hi:
            mid = (lo + hi) // 2
            if differs(mid):
                hi = mid
            else:
                lo = mid + 1
        n = ops[hi]
        module, line, code = _where(n)
        ea, en = _summary(eager[n.name])
        ca, cn = _summary(_compiled_value(g, n, backend, target.autocast_on(dev)))
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        return GraphOp(str(name), n.name, module, line, code, ea, ca, en, cn)
    return None


def _compiled_value(g: _Graph, node: fx.Node, backend: str, autocast: Any) -> Any:
    assert g.inputs is not None
    torch._dynamo.reset()
    part = torch.compile(_prefix(g.gm, node), backend=backend)
    try:
        with torch.no_grad(), autocast:
            return part(*g.inputs)
    finally:
        torch._dynamo.reset()


def compile_facts(results: dict[str, Any], target: Rung, model: nn.Module, spec: Spec, batches: Any,
                  init_state: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any] | None:
    """The compile stage's failure bisected (``CompileBisect.as_facts``), or None when it ran clean (or did not run).

    The step is the compile stage's first faulty one, replayed from the weights before it (the stage's snapshot; the
    initial weights for a failure at its first step) at unit loss scale: GradScaler's own overflows are not a compile
    problem."""
    from ampdoctor.input.batches import micro_batches

    res = results.get("compile")
    if res is None or (res.error is None and res.snapshot_step is None):
        return None
    if res.snapshot is not None and res.snapshot_step is not None:
        state, step = res.snapshot, int(res.snapshot_step)
    elif res.error is not None and res.error.step == 0:
        state, step = init_state, 0
    else:
        return None
    try:
        found = bisect(model, state, spec, micro_batches(batches[step]), target, device, step)
    finally:
        model.load_state_dict(init_state)
    return found.as_facts()


def uncompiled(build: Callable[[], Any], seen: list[str]) -> Callable[[], Any]:
    """``build_model`` that hands triage the module under a ``torch.compile`` wrapper (an ``OptimizedModule``), noting
    in ``seen`` that the spec's model was compiled: triage then runs the compile rung as ``--compile`` asks."""

    def unwrapped() -> Any:
        model = build()
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            seen.append(type(model._orig_mod).__name__)
            return model._orig_mod
        return model

    return unwrapped
