"""The layers report: the result of ``ampdoctor layers`` as one JSON-able document every renderer reads.

``build(df, config, environment)`` turns the ``layer_stats`` DataFrame into::

    {schema_version, tool: "ampdoctor layers", formats: [{dtype, grad_scale, steps, recommendation, rows}],
     reproduce, environment, config}

``rows`` are the per-tensor summaries (worst value over the steps) of the format's table, in the
``--sort`` order; ``recommendation`` is what ``advise`` says, as data and as plain-text advice items.
Described by ``ampdoctor/schema/layers.schema.json`` (see docs/report-format.md). Nothing here prints.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from typing import Any

import pandas as pd

from ampdoctor.fmt import command, pow2
from ampdoctor.formats import BF16
from ampdoctor.judge.ranges import DEFAULT_TOLERANCE, GRAD_KINDS, advise, format_table, sort_summary, tensor_name
from ampdoctor.report.model import _clean
from ampdoctor.report.words import layers as words

SCHEMA_VERSION = 1
TOOL = "ampdoctor layers"

KIND_LABEL = {"act": "act", "act_grad": "∂act", "param": "param", "param_grad": "∂param"}
"""Short kind labels for tables: ∂ marks a gradient."""

HEADLINES = words.HEADLINES
"""verdict → (headline, detail) (``report.words.layers``)."""

DEFAULTS: dict[str, Any] = {"dtype": ["fp16"], "steps": 3, "scale": 1.0, "what": ["activations", "grads", "weights"],
                            "sort": "risk", "top": 40, "filter": None, "underflow_tolerance": DEFAULT_TOLERANCE,
                            "device": "auto", "seed": 0, "model_fn": "build_model", "data_fn": "build_dataloader",
                            "loss_fn": "loss_fn", "optimizer_fn": "build_optimizer"}
"""The options of ``ampdoctor layers`` that shape a run or its tables, with their defaults (``config`` holds them all)."""

_FLAGS = (("dtype", "--dtype"), ("steps", "--steps"), ("scale", "--scale"), ("what", "--what"), ("sort", "--sort"),
          ("top", "--top"), ("filter", "--filter"), ("underflow_tolerance", "--underflow-tolerance"), ("device", "--device"),
          ("seed", "--seed"))
_NAMES = (("model_fn", "--model-fn"), ("data_fn", "--data-fn"), ("loss_fn", "--loss-fn"), ("optimizer_fn", "--optimizer-fn"))


def recommendation(df: pd.DataFrame, dtype: str, tolerance: float = DEFAULT_TOLERANCE, grads: bool = True) -> dict[str, Any]:
    """What ``advise`` says about ``dtype``, as data plus ``advice``: plain-text items ``{level, text}``."""
    a = advise(df, dtype, tolerance)
    c = a.scale
    head, detail = words.headline(a.verdict, dtype, tolerance)
    notes = [words.note(n) for n in a.notes]
    keep = {m: words.keep_reason(r) for m, r in a.keep_high.items()}
    over, under = words.tensor(c.overflow_limit), words.tensor(c.underflow_limit)
    items: list[tuple[int, str]] = [(0, n) for n in notes]
    if keep:
        items.append((0, words.KEEP_HIGH))
        items += [(1, f"{m}: {why}") for m, why in keep.items()]
    init_scale: float | None = None
    if grads and dtype != BF16.name:
        if c.overflow_limit is not None:
            init_scale = c.scale
            items.append((0, words.loss_scale(c.scale, over)))
        else:
            items.append((0, words.NO_GRADIENT))
        if c.fits and c.lo > 0:
            items.append((0, words.window(c.lo, c.hi, tolerance, under)))
    elif grads and c.scale == 1.0:
        init_scale = 1.0
        items.append((0, words.BF16_NO_SCALE))
    if a.bf16_fixes is not None:
        items.append((0, words.bf16(a.bf16_fixes)))
    return {
        "verdict": a.verdict,
        "safe": a.verdict == "safe",
        "headline": head,
        "detail": detail,
        "keep_high": [{"module": m, "reason": why} for m, why in keep.items()],
        "loss_scale": {"init_scale": init_scale, "min_scale": c.lo, "max_scale": c.hi, "fits": c.fits,
                       "overflow_limit": over if c.overflow_limit is not None else None,
                       "underflow_limit": under if c.underflow_limit is not None else None} if grads else None,
        "bf16_fixes": a.bf16_fixes,
        "notes": notes,
        "inner_ops": list(a.inner),
        "advice": [{"level": lv, "text": t} for lv, t in items],
    }


def _float(x: Any) -> float | None:
    """A float, None for NaN (not measured / no value); ±inf stays (written as "inf" in JSON)."""
    v = float(x)
    return None if math.isnan(v) else v


def rows(summary: pd.DataFrame) -> list[dict[str, Any]]:
    """Summary rows as records: the table's columns, windows only for gradients, NaN as None."""
    out = []
    for r in summary.itertuples(index=False):
        grad = r.kind in GRAD_KINDS
        out.append({
            "module": str(r.module), "kind": str(r.kind), "param": str(r.param),
            "tensor": tensor_name(str(r.module), str(r.kind), str(r.param)), "order": int(r.order),
            "scale": float(r.scale), "numel": int(r.numel), "absmax": float(r.absmax), "min_nonzero": _float(r.min_nonzero),
            "overflow_frac": float(r.overflow_frac), "underflow_frac": float(r.underflow_frac),
            "subnormal_frac": float(r.subnormal_frac), "nonfinite_frac": float(r.nonfinite_frac),
            "nan_frac": float(r.nan_frac), "inf_frac": float(r.inf_frac), "zero_frac": float(r.zero_frac),
            "headroom_binades": float(r.headroom_binades),
            "min_scale": float(r.min_scale) if grad else None, "max_scale": float(r.max_scale) if grad else None,
        })
    return out


def reproduce_command(config: dict[str, Any], environment: dict[str, Any] | None = None) -> str | None:
    """The layers command with every option that shapes the run and its tables (``--device auto`` → where it ran)."""
    parts = command("layers", config, _FLAGS, (environment or {}).get("device"))
    if parts is None:
        return None
    for key, flag in _NAMES:
        v = config.get(key)
        if v is not None and v != DEFAULTS[key]:
            parts += [flag, shlex.quote(str(v))]
    return " ".join(parts)


def build(df: pd.DataFrame, config: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    """The report document of a ``layer_stats`` DataFrame, shaped by the command's options in ``config``.

    ``config`` keys (missing ones take ``DEFAULTS``): ``dtype`` (the formats to report, in order),
    ``scale`` (a number or ``"auto"``), ``sort``, ``filter``, ``underflow_tolerance``, ``what``,
    ``steps``, and whatever else the run had (``spec``, ``seed``, ``device``...): all kept verbatim.
    """
    cfg = {**DEFAULTS, **config}
    tol = float(cfg["underflow_tolerance"])
    what = cfg["what"].split(",") if isinstance(cfg["what"], str) else list(cfg["what"])
    grads = "grads" in what
    formats = []
    for dtype in cfg["dtype"]:
        s, summary = format_table(df, dtype, cfg["scale"], cfg["filter"])
        steps = int(df.loc[df["dtype"] == dtype, "step"].nunique()) if not df.empty else 0
        formats.append({"dtype": dtype, "grad_scale": s, "steps": steps,
                        "recommendation": recommendation(df, dtype, tol, grads),
                        "rows": rows(sort_summary(summary, cfg["sort"]))})
    return {"schema_version": SCHEMA_VERSION, "tool": TOOL, "formats": formats,
            "reproduce": reproduce_command(config, environment), "environment": environment, "config": config}


def to_json(doc: dict[str, Any]) -> str:
    """The JSON text: non-finite numbers as the strings "nan", "inf", "-inf" (like the triage report)."""
    return json.dumps(_clean(doc), indent=2) + "\n"


def risk_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows worst first: NaN/Inf, then overflow, underflow, subnormal fractions (stable)."""
    return sorted(rows, key=lambda r: (-r["nonfinite_frac"], -r["overflow_frac"], -r["underflow_frac"], -r["subnormal_frac"]))


def is_bad(row: Mapping[str, Any]) -> bool:
    return row["overflow_frac"] > 0 or row["nonfinite_frac"] > 0


def window_text(row: Mapping[str, Any]) -> str:
    """'2^-4..2^13' for a gradient's loss-scale window, '' otherwise."""
    if row.get("min_scale") is None or row.get("max_scale") is None:
        return ""
    return f"{pow2(row['min_scale'])}..{pow2(row['max_scale'])}"
