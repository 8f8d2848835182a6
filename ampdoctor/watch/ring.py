"""The lookback ring: the last K steps of a run, per step and per layer, in a fixed host buffer.

The Monitor fills it after each step from what that step's one host copy already brought back (the
record's scalars, ``StepStats``' rows, and the per-parameter gradient norms and optimizer figures the
recipe packs into the same copy): no tensor is read here, so the ring adds no host sync. The buffers
are allocated once (``Ring(K, modules)``) and overwritten in place; ``memory_bytes`` says their size.
A recorded step's layer figures are computed when the ring is next read (the forecast, the spike
trigger, a capture's tables) or at the ``FILL_EVERY``-th step waiting, for all the steps waiting in one
pass of array operations: the same figures, for a sixteenth of the calls.

Per step (``STEP_COLUMNS``): loss, the global gradient norm, the loss scale used, skipped, the learning
rate, and the model input's element count and largest |x| (a new sequence length, a spiking batch).
Per layer on the steps the hooks record (``LAYER_COLUMNS``): the module output's largest finite |x|,
its headroom in binades below the format's max (NaN when it held non-finite values), its overflow, flush and
non-finite shares, its parameters' gradient norm and update norm, and the smallest of Adam's
``exp_avg_sq`` over its parameters. A layer is a module; an output that is also its parent's output
(the model returning its last layer's output) is counted once, for the innermost module.

``tables()`` gives the two tables the capture writes (``ring_steps.csv``, ``ring_layers.csv``;
docs/capture-format.md), in the run's own step numbers, oldest first.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from ampdoctor.formats import Format
from ampdoctor.records import MODEL, NCOLS, Col, StepStats

# the ring's two tables in a capture folder (read back by ``capture.schema.read_ring``)
RING_STEPS_FILE = "ring_steps.csv"
RING_LAYERS_FILE = "ring_layers.csv"
RING_STEP_COLUMNS: tuple[str, ...] = ("step", "loss", "grad_norm", "scale", "skipped", "lr", "input_numel", "input_absmax",
                                      "recorded")
"""``ring_steps.csv``: one row per kept step, oldest first (an empty cell: not known at that step)."""
RING_LAYER_COLUMNS: tuple[str, ...] = ("step", "layer", "absmax", "headroom", "overflow_frac", "flush_frac",
                                       "nonfinite_frac", "grad_norm", "update_norm", "exp_avg_sq_min")
"""``ring_layers.csv``: one row per layer and recorded step (docs/capture-format.md)."""

DEFAULT_STEPS = 256
"""Steps the ring keeps (``Monitor(ring=...)``)."""

STEP_COLUMNS: tuple[str, ...] = RING_STEP_COLUMNS[1:]
LAYER_COLUMNS: tuple[str, ...] = RING_LAYER_COLUMNS[2:]
STEPS_FILE = RING_STEPS_FILE
LAYERS_FILE = RING_LAYERS_FILE

_ABSMAX, _HEADROOM, _OVER, _FLUSH, _NONFIN, _GNORM, _UNORM, _VMIN = range(len(LAYER_COLUMNS))
_S = {n: i for i, n in enumerate(STEP_COLUMNS)}
_FILLED = frozenset({"input_numel", "input_absmax"})
"""The step columns the layer fill writes (``Ring._flush``)."""

FILL_EVERY = 16
"""Recorded steps whose layer figures wait, at most, to be computed together (a read computes them at once)."""


class _Pending:
    """A recorded step waiting for its layer figures: its slot, where its outputs' rows are (``Ring._sources``),
    the recipe's figures."""

    __slots__ = ("outs", "slot", "tail")

    def __init__(self, slot: int, outs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None,
                 tail: Any) -> None:
        self.slot, self.outs, self.tail = slot, outs, tail

    def same_layout(self, o: _Pending) -> bool:
        """The same layers in the same order (the rows' and the figures' index vectors are the same objects)."""
        if (self.outs is None) != (o.outs is None) or (self.tail is None) != (o.tail is None):
            return False
        if self.outs is not None and o.outs is not None and (
                self.outs[2] is not o.outs[2] or len(self.outs[1]) != len(o.outs[1])
                or self.outs[0].shape[1] != o.outs[0].shape[1]):
            return False
        if self.tail is not None and o.tail is not None:
            a, b = self.tail[0], o.tail[0]
            return (a[0] is b[0] and a[1] is b[1] and a[2] is b[2] and np.shape(a[3]) == np.shape(b[3])
                    and self.tail[1].shape == o.tail[1].shape)
        return True



def module_of(param: str, modules: dict[str, int]) -> int | None:
    """The index of the module that owns a parameter name ('blocks.0.attn.q.weight' → 'blocks.0.attn.q')."""
    name = param
    while True:
        cut = name.rfind(".")
        name = name[:cut] if cut >= 0 else ""
        i = modules.get(name or MODEL)
        if i is not None or not name:
            return i


class Ring:
    """The last ``steps`` steps; ``modules``: the model's module names (``MODEL`` is the model itself)."""

    def __init__(self, steps: int, modules: list[str], fmt: Format) -> None:
        self.capacity = int(steps)
        self.fmt = fmt
        self.names = list(dict.fromkeys(modules))
        self._index = {n: i for i, n in enumerate(self.names)}
        self.steps = np.full(self.capacity, -1, dtype=np.int64)
        self.scalars = np.full((self.capacity, len(STEP_COLUMNS)), np.nan, dtype=np.float64)
        self.layers = np.full((self.capacity, len(self.names), len(LAYER_COLUMNS)), np.nan, dtype=np.float32)
        self.count = 0
        """Steps pushed so far (the newest is at ``(count - 1) % capacity``)."""
        self.param_modules: list[int | None] = []
        """Per parameter of the recipe (its order), the module index that owns it."""
        self._param_modules: np.ndarray | None = None
        self._log_max = math.log2(fmt.max)
        self._plan_key: Any = None
        self._plan_cache: tuple[list[int], np.ndarray] = ([], np.zeros(0, dtype=np.int64))
        self._gather: Any = None
        """(plan ids, row keys, model inputs, row positions, their layers, the inputs' positions) of the last step."""
        self._owner_cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._unique_cache: tuple[Any, bool] = (None, False)
        self._pending: list[_Pending] = []
        """Recorded steps whose layer figures are not computed yet (``_flush``: at most ``FILL_EVERY`` of them)."""
        self._rows_buf = np.empty((0, 0, NCOLS))
        """The waiting steps' output rows, gathered (kept from flush to flush)."""

    # -- filling ---------------------------------------------------------------------------------
    def set_params(self, names: list[str]) -> None:
        """The recipe's parameters (in the order their per-parameter figures are packed)."""
        self.param_modules = [module_of(n, self._index) for n in names]
        self._param_modules = np.array([-1 if m is None else m for m in self.param_modules] or [-1], dtype=np.int64)

    @property
    def memory_bytes(self) -> int:
        return int(self.steps.nbytes + self.scalars.nbytes + self.layers.nbytes)

    def push(self, step: int, *, loss: float, grad_norm: float, scale: float | None, skipped: bool, lr: float | None,
             stats: StepStats | None) -> None:
        """One step, from its record and statistics (host values: nothing here reads a tensor)."""
        i = self.count % self.capacity
        self.count += 1
        self.steps[i] = step
        row = self.scalars[i]
        row[:] = np.nan
        row[_S["loss"]] = loss
        row[_S["grad_norm"]] = grad_norm
        row[_S["scale"]] = scale if scale is not None else np.nan
        row[_S["skipped"]] = float(skipped)
        row[_S["lr"]] = lr if lr is not None else np.nan
        row[_S["recorded"]] = float(stats is not None)
        lay = self.layers[i]
        lay[:] = np.nan
        if stats is None:
            return
        # the rows this step's figures come from, taken now (the step's record may go); the arithmetic waits for
        # the next read or the FILL_EVERY-th recorded step, and then runs once for all the steps waiting
        outs = self._sources(stats) if stats.row_matrix is not None or stats.act else None
        tail = stats.tail if stats.tail is not None and self._param_modules is not None else None
        self._pending.append(_Pending(i, outs, tail))
        if len(self._pending) >= min(FILL_EVERY, self.capacity):  # (no slot is overwritten while it waits)
            self._flush()

    def _flush(self) -> None:
        """The layer figures of the steps waiting: runs of steps with the same layout (the usual run: every
        step's) in one pass of array operations, the same figures each step's own pass gives."""
        pend, self._pending = self._pending, []
        k = 0
        while k < len(pend):
            j = k + 1
            while j < len(pend) and pend[j].same_layout(pend[k]):
                j += 1
            self._fill_run(pend[k:j])
            k = j

    def _fill_run(self, run: list[_Pending]) -> None:
        slots = np.array([p.slot for p in run], dtype=np.int64)
        first = run[0]
        for p in run:  # the model input's figures (step columns)
            if p.outs is not None and len(p.outs[3]):
                ins = p.outs[0][p.outs[3]]
                row = self.scalars[p.slot]
                row[_S["input_numel"]] = float(ins[:, Col.NUMEL].sum())
                row[_S["input_absmax"]] = float(ins[:, Col.ABSMAX].max())
        if first.outs is not None and len(first.outs[1]):
            mi = first.outs[2]
            if self._unique_cache[0] is not mi:
                self._unique_cache = (mi, len(np.unique(mi)) == len(mi))
            if self._unique_cache[1] and len(run) > 1:
                # the rows gathered into a buffer kept from flush to flush (a fresh array's first touch costs
                # more than the arithmetic on it)
                shape = (len(run), len(mi), first.outs[0].shape[1])
                if self._rows_buf.shape[1:] != shape[1:] or len(self._rows_buf) < len(run):
                    self._rows_buf = np.empty((max(len(run), FILL_EVERY), *shape[1:]))
                buf = self._rows_buf[: len(run)]
                for j, p in enumerate(run):
                    assert p.outs is not None
                    np.take(p.outs[0], p.outs[1], axis=0, out=buf[j])
                self._fill_outputs_many(slots, buf, mi)
            else:
                for p in run:
                    assert p.outs is not None
                    self._fill_outputs(p.slot, p.outs[0][p.outs[1]], p.outs[2])
        if first.tail is not None:
            self._fill_params(slots, [p.tail for p in run])

    def _plan(self, st: StepStats) -> tuple[list[int], np.ndarray]:
        """(output tensor ids, their layers' indices) of the step's calls, each tensor once: (module, output tensor
        ids) in the order the calls ended, inner modules first, so an output that is also its parent's (the model
        returning its last layer's) is the inner module's. The C++ recorder's calls repeat from step to step:
        the last plan is kept, and reused while the calls are the same lists."""
        fc = st.flat_calls
        key = None
        if len(fc) == 1 and not st.__dict__.get("_calls"):
            key = fc[0]
            last = self._plan_key
            if last is not None and last[0] is key[0] and all(a is b or a == b for a, b in zip(last[1:], key[1:], strict=True)):
                return self._plan_cache
        index = self._index
        mods: list[int] = []
        tids: list[int] = []
        seen: set[int] = set()
        for name, outs in _calls(st):
            m = index.get(name)
            if m is None:
                continue
            for t in outs:
                if t not in seen:
                    seen.add(t)
                    mods.append(m)
                    tids.append(t)
        plan = (tids, np.asarray(mods, dtype=np.int64))
        if key is not None:
            self._plan_key, self._plan_cache = key, plan
        return plan

    def _sources(self, st: StepStats) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(a row matrix, the positions in it of the plan's outputs that have a row, their layers' indices, the
        positions of the model inputs' rows): the step's own row matrix while it is one (``StepStats.row_matrix``:
        no copy), with the positions worked out once and kept while the plan and the rows' keys repeat (the same
        objects step to step), else a matrix made of the dicts (a step put together by hand, or already read)."""
        tids, mi = self._plan(st)
        rm = st.row_matrix
        inputs = tuple(st.model_inputs)
        if rm is None:
            act = st.act
            found = [act.get(t) for t in tids]
            rows = [x for x in found if x is not None]
            if len(rows) < len(found):  # (an output without a row: left out)
                mi = mi[[k for k, x in enumerate(found) if x is not None]]
            ins = [act[t] for t in inputs if t in act]
            both = rows + ins
            m = np.concatenate(both).reshape(len(both), -1) if both else np.zeros((0, NCOLS))
            return (m, np.arange(len(rows), dtype=np.int64), mi,
                    np.arange(len(rows), len(both), dtype=np.int64))
        keys, matrix = rm
        c = self._gather
        if c is None or c[0] is not tids or c[2] != inputs or (c[1] is not keys and c[1] != keys):
            index = {k[1]: i for i, k in enumerate(keys) if k[0] == "act"}
            pos = [index.get(t, -1) for t in tids]
            ok = [k for k, q in enumerate(pos) if q >= 0]
            c = self._gather = (tids, keys, inputs, np.array([pos[k] for k in ok], dtype=np.int64), mi[ok],
                                np.array([index[t] for t in inputs if t in index], dtype=np.int64))
        return matrix, c[3], c[4], c[5]

    def _outputs(self, st: StepStats) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows [k, NCOLS] of the plan's outputs that have one, their layers' indices, the model inputs' rows)."""
        m, pos, mi, ins = self._sources(st)
        return m[pos], mi, m[ins]

    def _fill_outputs(self, slot: int, r: np.ndarray, mi: np.ndarray) -> None:
        """One step's layer output figures from its outputs' rows (a layer with several outputs: summed, the max)."""
        bad = r[:, Col.POSINF] + r[:, Col.NEGINF] + r[:, Col.NAN]
        if self._unique_cache[0] is not mi:
            self._unique_cache = (mi, len(np.unique(mi)) == len(mi))
        if self._unique_cache[1]:  # one output a layer (the usual model): no reduction
            have, a, numel, over, flush = mi, r[:, Col.ABSMAX], r[:, Col.NUMEL], r[:, Col.OVERFLOW], r[:, Col.UNDERFLOW]
        else:
            n = len(self.names)
            absmax = np.zeros(n)
            np.maximum.at(absmax, mi, r[:, Col.ABSMAX])
            sums = np.zeros((n, 4))
            np.add.at(sums, mi, np.stack([r[:, Col.NUMEL], r[:, Col.OVERFLOW], r[:, Col.UNDERFLOW], bad], axis=1))
            got = np.zeros(n, dtype=bool)
            got[mi] = True
            have = np.flatnonzero(got)
            a, numel, over, flush, bad = absmax[have], sums[have, 0], sums[have, 1], sums[have, 2], sums[have, 3]
        self._put_outputs((slot, have), a, numel, over, flush, bad)

    def _fill_outputs_many(self, slots: np.ndarray, r: np.ndarray, mi: np.ndarray) -> None:
        """``_fill_outputs`` of several steps at once: ``r`` [steps, k, NCOLS], one output a layer (``mi`` unique)."""
        bad = r[..., Col.POSINF] + r[..., Col.NEGINF] + r[..., Col.NAN]
        self._put_outputs((slots[:, None], mi[None, :]), r[..., Col.ABSMAX], r[..., Col.NUMEL], r[..., Col.OVERFLOW],
                          r[..., Col.UNDERFLOW], bad)

    def _put_outputs(self, at: tuple[Any, ...], a: np.ndarray, numel: np.ndarray, over: np.ndarray, flush: np.ndarray,
                     bad: np.ndarray) -> None:
        """The output columns from a layer's largest |x| and its counts, written at ``self.layers[(*at, column)]``
        (``at``: (one slot, its layers), or (slots, layers) broadcast for several steps)."""
        numel = np.maximum(numel, 1.0)
        bad = bad / numel
        with np.errstate(divide="ignore"):
            h = np.where(a > 0, self._log_max - np.log2(np.where(a > 0, a, 1.0)), np.inf)
        h = np.where(bad > 0, np.nan, h)  # a non-finite output has no headroom figure: nonfinite_frac says how much
        for col, v in ((_ABSMAX, a), (_HEADROOM, h), (_OVER, over / numel), (_FLUSH, flush / numel), (_NONFIN, bad)):
            self.layers[(*at, col)] = v

    def _fill_params(self, slots: np.ndarray, tails: list[Any]) -> None:
        """The layers' parameter figures of steps whose recipe vectors (``engine.ring.RingFigures``) have the same
        layout (the same index vectors): a layer's norm over its parameters' figures, its smallest ``exp_avg_sq``."""
        (grad_j, upd_j, vmin_j, _), _ = tails[0]
        vals = np.stack([t[1] for t in tails])
        factor = np.stack([np.asarray(t[0][3], dtype=np.float64) for t in tails])  # (a number or one a figure)
        if factor.ndim == 1:
            factor = factor[:, None]
        n, g = len(self.names), len(tails)
        lay = self.layers
        k = 0
        for col, js in ((_GNORM, grad_j), (_UNORM, upd_j)):
            v = vals[:, k: k + len(js)]
            if col == _UNORM and len(js):
                v = v * factor
            k += len(js)
            ok, owner = self._owners(js)
            if len(ok):
                sq = np.zeros((g, n))
                with np.errstate(over="ignore", invalid="ignore"):
                    w = v[:, ok]
                    np.add.at(sq, (np.arange(g)[:, None], owner[None, :]), w * w)
                got = np.flatnonzero(np.bincount(owner, minlength=n))
                lay[slots[:, None], got[None, :], col] = np.sqrt(sq[:, got])
        v = vals[:, k: k + len(vmin_j)]
        ok, owner = self._owners(vmin_j)
        if len(ok):
            lo = np.full((g, n), np.inf)
            with np.errstate(invalid="ignore"):
                np.minimum.at(lo, (np.arange(g)[:, None], owner[None, :]), v[:, ok])
            got = np.isfinite(lo)
            cur = lay[slots, :, _VMIN]
            lay[slots, :, _VMIN] = np.where(got, lo, cur)

    def _owners(self, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in ``js`` of the figures a layer owns, those layers) for a layout vector (kept per vector: the
        recipe hands the same arrays while its parameters and optimizer state stay the same)."""
        hit = self._owner_cache.get(id(js))
        if hit is not None and hit[0] is js:
            return hit[1], hit[2]
        assert self._param_modules is not None
        owner = np.where(js >= 0, self._param_modules[js], -1) if len(js) else js
        ok = np.flatnonzero(owner >= 0)
        if len(self._owner_cache) > 16:
            self._owner_cache.clear()
        self._owner_cache[id(js)] = (js, ok, owner[ok])
        return ok, owner[ok]

    # -- reading ---------------------------------------------------------------------------------
    def order(self) -> np.ndarray:
        """Slot indices, oldest first."""
        n = min(self.count, self.capacity)
        start = self.count - n
        return (np.arange(start, self.count) % self.capacity).astype(np.int64)

    def layer_series(self, column: str, last: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps [n], values [n, layers]) of one layer column over the ring's recorded steps, oldest first."""
        self._flush()
        idx = self.order()
        if last is not None:
            idx = idx[-last:]
        rec = self.scalars[idx, _S["recorded"]] == 1.0
        idx = idx[rec]
        return self.steps[idx], self.layers[idx, :, LAYER_COLUMNS.index(column)]

    def step_series(self, column: str, last: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        if column in _FILLED:
            self._flush()
        idx = self.order()
        if last is not None:
            idx = idx[-last:]
        return self.steps[idx], self.scalars[idx, _S[column]]

    def tables(self) -> tuple[str, str]:
        """(steps CSV, layers CSV): every kept step, oldest first; a layers row per layer and recorded step
        that has any figure."""
        self._flush()
        idx = self.order()
        out = io.StringIO()
        out.write("step," + ",".join(STEP_COLUMNS) + "\n")
        for i in idx:
            out.write(f"{int(self.steps[i])}," + ",".join(_cell(v) for v in self.scalars[i]) + "\n")
        lay = io.StringIO()
        lay.write("step,layer," + ",".join(LAYER_COLUMNS) + "\n")
        for i in idx:
            if self.scalars[i, _S["recorded"]] != 1.0:
                continue
            cells = self.layers[i]
            keep = ~np.all(np.isnan(cells), axis=1)
            for m in np.flatnonzero(keep):
                name = self.names[m]
                lay.write(f"{int(self.steps[i])},{_csv_name(name)}," + ",".join(_cell(v) for v in cells[m]) + "\n")
        return out.getvalue(), lay.getvalue()


def _cell(v: Any) -> str:
    f = float(v)
    if math.isnan(f):
        return ""
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return repr(f) if not f.is_integer() else str(int(f)) if abs(f) < 1e15 else repr(f)


def _csv_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"' if any(c in name for c in ',"\n') else name


def _calls(st: StepStats) -> Any:
    """(module name, output tensor ids) of each call, without making ``Call`` objects of the C++ recorder's."""
    if st.flat_calls:
        for names, mods, bounds, tids in st.flat_calls:
            for k, m in enumerate(mods):
                yield names[m], tids[bounds[2 * k + 1]: bounds[2 * k + 2]]
    own = st.__dict__.get("_calls") or []
    for c in own:
        yield c.module, c.outputs


__all__ = ["DEFAULT_STEPS", "LAYERS_FILE", "LAYER_COLUMNS", "MODEL", "STEPS_FILE", "STEP_COLUMNS", "Ring", "module_of"]
