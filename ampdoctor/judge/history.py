"""Read the lookback ring (``watch.ring``): the forecast, the spike test and the story before a failure.

Everything here is numbers over the ring's arrays or its two tables; the words are in
``report.words``. The rules (docs/diagnosis.md, "Lookback and forecast"):

**Forecast.** A layer's output leaves FP16's range when its largest |x| passes the format's max
(65504). Over the last ``window`` recorded steps where the output stayed finite, fit its largest |x|
against the step with Theil–Sen (the median of the pairwise slopes: one batch's outlier moves it
nowhere) and test the trend with Mann–Kendall. The layer is on course to leave the range when

1. the trend is real: Mann–Kendall's z is at least ``TREND_Z`` (3: a rise this steady comes from noise
   about once in a thousand windows) over at least ``MIN_POINTS`` points;
2. extrapolated linearly *in value* from the fit's value now, it reaches the format's max within
   ``horizon`` steps: ``(max - a_now) / slope <= horizon``.

Linear in value is the slowest growth a rising layer can have short of flattening: growth that
compounds (the product of two growing projections, a runaway residual stream) reaches the max
sooner, so the expected step is the latest one the present trend allows, and a layer that merely
grew during warm-up (a few units a step, thousands of steps from 65504) is never called.

**Spike.** A value is a spike when it is above the median of the ``window`` values before it by
more than ``sigmas`` robust standard deviations (1.4826 x the median absolute deviation), the
definition of OLMo-core's and llm-foundry's loss-spike checks with a median in place of the mean.

**Story.** A layer left its baseline at the first step where its figure (the output's largest |x|,
its gradient norm, its update norm) is more than one binade (a factor of 2), and more than
``LEAVE_Z`` times its step-to-step noise (robust, from the differences), away from its own median
over its first ``BASELINE_STEPS`` steps in the ring.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ampdoctor.records import MODEL

MIN_POINTS = 32
"""Recorded steps a layer needs in the window before its trend is judged."""
WINDOW = 64
"""Recorded steps the forecast fits."""
TREND_Z = 3.0
"""Mann–Kendall z a trend must reach (one-sided p about 0.0013)."""
DEFAULT_HORIZON = 1000
LEAVE_Z = 4.0
"""Robust z (over the figure's step-to-step noise) a figure must pass to have left its baseline (with one binade)."""
BASELINE_STEPS = 8
"""A layer's baseline: the median of its first recorded steps in the ring."""
MAD_SIGMA = 1.4826
"""The standard deviation of a normal distribution over its median absolute deviation."""


@dataclass(frozen=True)
class Forecast:
    """A layer on course to leave the format's range."""

    layer: str
    step: int
    """The step the forecast was made at (the run's own)."""
    absmax: float
    """The fit's largest |x| now."""
    headroom: float
    """log2(max / absmax) now, in binades."""
    slope: float
    """Growth of the largest |x|, per step."""
    binades_per_100: float
    """The headroom it loses per 100 steps at that growth, now."""
    expected_step: int
    """The step at which the trend reaches the format's max: with the growth's acceleration where it
    accelerates (the two halves of the window's slopes), else ``latest_step``."""
    latest_step: int
    """The step at which the present growth, linear, reaches the max (the latest, unless the growth slows)."""
    z: float
    """Mann–Kendall z of the trend."""
    points: int


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept): the median pairwise slope and the median of ``y - slope * x``."""
    i, j = np.triu_indices(len(x), 1)
    dx = x[j] - x[i]
    ok = dx != 0
    slope = float(np.median((y[j] - y[i])[ok] / dx[ok])) if ok.any() else 0.0
    return slope, float(np.median(y - slope * x))


def mann_kendall_z(y: np.ndarray) -> float:
    """Mann–Kendall's z of a monotone trend in ``y`` (in order); positive for a rise. No tie correction."""
    n = len(y)
    if n < 3:
        return 0.0
    i, j = np.triu_indices(n, 1)
    s = float(np.sign(y[j] - y[i]).sum())
    var = n * (n - 1) * (2 * n + 5) / 18.0
    if s > 0:
        return (s - 1) / math.sqrt(var)
    if s < 0:
        return (s + 1) / math.sqrt(var)
    return 0.0


def forecast(steps: np.ndarray, absmax: np.ndarray, nonfinite: np.ndarray, names: list[str], fmt_max: float,
             horizon: int = DEFAULT_HORIZON, window: int = WINDOW) -> list[Forecast]:
    """The layers on course to pass ``fmt_max`` within ``horizon`` steps, soonest first.

    ``steps`` [n] (recorded steps, oldest first), ``absmax`` and ``nonfinite`` [n, layers] (the ring's
    columns; NaN where a layer was not seen)."""
    if len(steps) < MIN_POINTS:
        return []
    steps = steps[-window:].astype(np.float64)
    a = absmax[-window:].astype(np.float64)
    bad = nonfinite[-window:]
    now = float(steps[-1])
    ok = np.isfinite(a) & (a > 0) & ~(bad > 0)
    # a quick bound first, over every layer at once: the rise from the window's first quarter to its last must be
    # at least half what the horizon asks for (Theil-Sen and the test run only on the few layers that pass it)
    q = max(len(steps) // 4, 1)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (a layer with no finite value in a quarter: no candidate)
        early = np.nanmedian(np.where(ok[:q], a[:q], np.nan), axis=0)
        late = np.nanmedian(np.where(ok[-q:], a[-q:], np.nan), axis=0)
        span = max(float(np.median(steps[-q:]) - np.median(steps[:q])), 1.0)
        need = (fmt_max - late) / horizon
        cand = np.flatnonzero(np.isfinite(early) & np.isfinite(late) & ((late - early) / span >= 0.5 * need))
    out: list[Forecast] = []
    for m in cand:
        keep = ok[:, m]
        if keep.sum() < MIN_POINTS:
            continue
        x, y = steps[keep], a[keep, m]
        slope, icpt = theil_sen(x, y)
        if not slope > 0:
            continue
        z = mann_kendall_z(y)
        if z < TREND_Z:
            continue
        a_now = max(icpt + slope * now, float(y[-1]) if y[-1] < fmt_max else 0.0, 1e-30)
        if a_now >= fmt_max:
            continue  # already at the max: the overflow is here, not ahead
        eta = (fmt_max - a_now) / slope
        if eta > horizon:
            continue
        soon = eta
        half = len(x) // 2
        s1, _ = theil_sen(x[:half], y[:half])
        s2, i2 = theil_sen(x[half:], y[half:])
        mid2 = float(np.median(x[half:]))
        dt = mid2 - float(np.median(x[:half]))
        acc = (s2 - s1) / dt if dt > 0 else 0.0
        if acc > 0:  # accelerating: from the newer half's value and slope now, a + v d + acc d^2 / 2 = max
            v = s2 + acc * (now - mid2)
            a2 = min(i2 + s2 * now + 0.5 * acc * (now - mid2) ** 2, fmt_max * (1 - 1e-9))
            a2 = max(a2, a_now)
            soon = (-v + math.sqrt(v * v + 2.0 * acc * (fmt_max - a2))) / acc
        out.append(Forecast(names[m], int(now), a_now, math.log2(fmt_max / a_now), slope,
                            100.0 * slope / (a_now * math.log(2.0)), int(math.ceil(now + soon)),
                            int(math.ceil(now + eta)), z, int(keep.sum())))
    # a named module before the model's own output (``MODEL``, the root's output: often that module's own, its trend
    # the same; a user cannot act on the root): the forecast names the module whose headroom is going (issue 45)
    out.sort(key=lambda f: (f.layer == MODEL, f.expected_step, f.layer))
    return out


def robust_z(value: float, history: np.ndarray) -> float:
    """How many robust standard deviations ``value`` lies above the median of ``history`` (finite values)."""
    h = history[np.isfinite(history)]
    if len(h) < 2 or not math.isfinite(value):
        return 0.0
    med = float(np.median(h))
    mad = float(np.median(np.abs(h - med))) * MAD_SIGMA
    if mad <= 0:
        mad = max(abs(med) * 1e-6, 1e-30)  # a flat history: any real rise is a spike
    return (value - med) / mad


@dataclass(frozen=True)
class Spike:
    step: int
    what: str
    """'loss' | 'grad_norm'"""
    value: float
    median: float
    z: float
    layers: list[dict[str, Any]] = field(default_factory=list)
    """The layers whose update norms spiked first: layer, step, z, ratio to their median."""


def spiking_layers(steps: np.ndarray, norms: np.ndarray, names: list[str], sigmas: float, since: int,
                   baseline: int) -> list[dict[str, Any]]:
    """Layers whose update (or gradient) norm spiked at or after ``since``, earliest and largest first.

    ``norms`` [n, layers]: the ring's column over its recorded steps ``steps``; each layer's baseline is its
    own ``baseline`` values before ``since``."""
    hits: list[dict[str, Any]] = []
    before = steps < since
    if before.sum() < 4:
        return hits
    for m, name in enumerate(names):
        col = norms[:, m].astype(np.float64)
        hist = col[before][-baseline:]
        if not np.isfinite(hist).any():
            continue
        med = float(np.nanmedian(hist))
        for k in np.flatnonzero(~before):
            z = robust_z(float(col[k]), hist)
            if z > sigmas and col[k] > 0:
                hits.append({"layer": name, "step": int(steps[k]), "z": float(min(z, 1e300)),
                             "ratio": float(col[k] / med) if med > 0 else 1e300})
                break
    hits.sort(key=lambda h: (h["step"], -h["z"]))
    return hits


# -- the story of a captured failure ----------------------------------------------------------------
def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f


def story(steps_df: Any, layers_df: Any, fail_step: int, culprit: str | None, fmt_max: float = 65504.0,
          top: int = 5, *, overflow: bool = True) -> dict[str, Any] | None:
    """The figures of the steps before ``fail_step`` from the ring's tables (pandas DataFrames, as
    ``capture.schema.read_ring`` gives them), or None when the ring holds too little.

    Returns: ``layer`` (the culprit: the one named, else the layer with least headroom at the failing step),
    ``crossed_step`` (its first step with no headroom left), its ``headroom`` series, ``movers`` (layers that left
    their baseline, earliest first), the step ``series`` (loss, gradient norm, scale, skipped, lr) and
    ``changes`` (the end of a warm-up, a new input size, a batch whose inputs spiked).

    A layer's output that held non-finite values has no headroom figure (the ring writes NaN; older captures 0).
    ``overflow`` (the verdict is an overflow): such a step counts as no headroom left, as the overflow made it.
    Else (a ``data`` verdict: the batch's own NaN/Inf went through) it stays non-finite: no layer is named but
    the verdict's, nothing "crosses", and ``nonfinite_step`` and ``least_headroom`` say what the layers did."""
    if steps_df is None or len(steps_df) < 2:
        return None
    sd = steps_df[steps_df["step"] <= fail_step].sort_values("step")
    if len(sd) < 2:
        return None
    out: dict[str, Any] = {"steps_kept": int(len(sd)), "first_step": int(sd["step"].iloc[0]), "fail_step": int(fail_step)}
    series: dict[str, list[Any]] = {"step": [int(s) for s in sd["step"]]}
    for c in ("loss", "grad_norm", "scale", "skipped", "lr"):
        series[c] = [_num(v) for v in sd[c]]
    out["series"] = series
    ld = layers_df[layers_df["step"] <= fail_step] if layers_df is not None and len(layers_df) else None
    if ld is not None and len(ld):
        head = ld.pivot_table(index="step", columns="layer", values="headroom", aggfunc="min", dropna=False).sort_index()
        bad = ld.pivot_table(index="step", columns="layer", values="nonfinite_frac", aggfunc="max", dropna=False)
        bad = bad.reindex(index=head.index, columns=head.columns).astype(float) > 0
        head = head.mask(bad, 0.0) if overflow else head.mask(bad)
        head = head.dropna(axis=1, how="all")  # (no activations recorded: no headroom, the other figures still tell)
        if not overflow:
            out["data"] = True
            _nonfinite_story(out, head, bad)
        layer = culprit if culprit in head.columns else None
        if layer is None and culprit:
            # the verdict may name an op inside the layer ('logits > matmul op') or a parent: the closest layer
            base = culprit.split(" > ")[0]
            cands = [c for c in head.columns if c == base or base.startswith(c + ".") or c.startswith(base + ".")]
            layer = max(cands, key=len) if cands else None
        if layer is None and overflow and len(head) and len(head.columns):
            last = head.iloc[-1].replace([np.inf], np.nan)
            layer = str(last.idxmin()) if last.notna().any() else None
        if layer is not None:
            h = head[layer]
            hs = [float(v) for v in h]
            out["layer"] = layer
            out["headroom"] = {"step": [int(s) for s in h.index], "binades": hs}
            fin = [v for v in hs if math.isfinite(v)]
            out["headroom_first"] = fin[0] if fin else math.nan
            out["headroom_last"] = (hs[-1] if overflow else fin[-1] if fin else math.nan) if hs else math.nan
            crossed = next((int(s) for s, v in zip(h.index, hs, strict=True) if v <= 0), None)
            out["crossed_step"] = crossed
            ab = ld[ld["layer"] == layer].sort_values("step")
            fa = ab["absmax"].astype(float)
            out["absmax_first"] = float(fa.iloc[0]) if len(fa) else math.nan
            finite = ab[(ab["nonfinite_frac"].astype(float) == 0) & (ab["step"] <= fail_step)]
            if len(finite):
                k = int(finite["absmax"].astype(float).to_numpy().argmax())
                out["absmax_peak"] = float(finite["absmax"].iloc[k])
                out["absmax_peak_step"] = int(finite["step"].iloc[k])
        out["movers"] = movers(ld, fail_step, top)
    out["changes"] = changes(sd, fail_step)
    return out


def _nonfinite_story(out: dict[str, Any], head: Any, bad: Any) -> None:
    """A data verdict's figures: the first step a layer's output went non-finite, and the least headroom any layer
    had while finite (how far the values stayed from an overflow)."""
    hit = bad.any(axis=1)
    if hit.any():
        out["nonfinite_step"] = int(hit[hit].index[0])
    fin = head.replace([np.inf, -np.inf], np.nan)
    if fin.notna().to_numpy().any():
        low = fin.min(axis=0)
        out["least_headroom"] = {"layer": str(low.idxmin()), "binades": float(low.min())}


def movers(ld: Any, fail_step: int, top: int = 5) -> list[dict[str, Any]]:
    """Layers whose figures left their own baseline before the failure: earliest first, then farthest (binades)."""
    figs = {"absmax": "output |x|", "grad_norm": "gradient norm", "update_norm": "update norm"}
    found: list[dict[str, Any]] = []
    for fig in figs:
        if fig not in ld.columns:
            continue
        piv = ld.pivot_table(index="step", columns="layer", values=fig, aggfunc="max").sort_index()
        piv = piv[piv.index < fail_step] if (piv.index < fail_step).sum() >= 8 else piv
        n = len(piv)
        if n < 8:
            continue
        nb = BASELINE_STEPS
        for layer in piv.columns:
            v = piv[layer].astype(float).to_numpy()
            with np.errstate(all="ignore"):
                lv = np.where(v > 0, np.log2(np.where(v > 0, v, 1.0)), np.nan)
            base = lv[:nb]
            base = base[np.isfinite(base)]
            fin_all = lv[np.isfinite(lv)]
            if len(base) < 4 or len(fin_all) < nb + 2:
                continue
            med = float(np.median(base))
            # the step-to-step noise (robust, from the differences: a trend does not inflate it)
            noise = float(np.median(np.abs(np.diff(fin_all) - np.median(np.diff(fin_all))))) * MAD_SIGMA / math.sqrt(2.0)
            dev = lv[nb:] - med
            with np.errstate(invalid="ignore"):
                left = np.flatnonzero(np.isfinite(dev) & (np.abs(dev) >= 1.0) & (np.abs(dev) > LEAVE_Z * max(noise, 1e-9)))
            if not len(left):
                continue
            k = int(left[0])
            fin = dev[np.isfinite(dev)]
            far = float(fin[-1]) if len(fin) else float(dev[k])
            found.append({"layer": str(layer), "figure": fig, "left_step": int(piv.index[nb + k]),
                          "binades": float(dev[k]), "binades_at_end": far})
    found.sort(key=lambda f: (f["left_step"], -abs(f["binades_at_end"])))
    best: dict[str, dict[str, Any]] = {}
    for f in found:  # one line per layer: its earliest departure
        best.setdefault(f["layer"], f)
    return list(best.values())[:top]


def changes(sd: Any, fail_step: int) -> list[dict[str, Any]]:
    """What changed in the kept steps: the end of the learning-rate warm-up, a new model-input size, an input batch
    or a loss far above its window."""
    out: list[dict[str, Any]] = []
    steps = [int(s) for s in sd["step"]]
    lr = [_num(v) for v in sd["lr"]]
    rises = 0
    for k in range(1, len(lr)):
        a, b = lr[k - 1], lr[k]
        if not (math.isfinite(a) and math.isfinite(b)):
            rises = 0
            continue
        if b > a * (1 + 1e-9):
            rises += 1
        elif rises >= 3:
            out.append({"kind": "warmup_end", "step": steps[k - 1], "lr": a})
            rises = 0
        else:
            rises = 0
    numel = [_num(v) for v in sd["input_numel"]]
    prev = None
    for s, v in zip(steps, numel, strict=True):
        if not math.isfinite(v):
            continue
        if prev is not None and v != prev:
            out.append({"kind": "input_size", "step": s, "before": prev, "after": v})
        prev = v
    for col, kind in (("input_absmax", "batch_spike"), ("loss", "loss_spike")):
        vals = np.array([_num(v) for v in sd[col]], dtype=np.float64)
        for k in range(16, len(vals)):
            if steps[k] > fail_step:
                break
            hist = vals[max(0, k - 64):k]
            z = robust_z(float(vals[k]), hist)
            if z >= 6.0 and vals[k] >= 2.0 * float(np.nanmedian(hist)):
                out.append({"kind": kind, "step": steps[k], "value": float(vals[k]), "median": float(np.nanmedian(hist)),
                            "z": float(z)})
                break  # the first: what came after it may be its consequence
    out.sort(key=lambda c: c["step"])
    return out


__all__ = ["DEFAULT_HORIZON", "Forecast", "Spike", "changes", "forecast", "mann_kendall_z", "movers", "robust_z",
           "spiking_layers", "story", "theil_sen"]
