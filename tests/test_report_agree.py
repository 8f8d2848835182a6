"""The report's words and pictures agree with themselves and with the verdict (issue 38, item 6): code set as
code in HTML, one count per fact, a culprit bar that is visible, labels off the lines they mark, every line in
a legend, and a lookback ring that keeps non-finite outputs non-finite (no overflow told for a ``data`` verdict)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from ampdoctor import Monitor
from ampdoctor.judge.history import story
from ampdoctor.render import common, html, markdown, plots
from ampdoctor.report.model import Finding, ScaleEvent, ScalerStory
from ampdoctor.report.words.findings import SCALER_NOTES
from ampdoctor.report.words.lookback import history_title

from .report_fixtures import make_report


def test_html_sets_quoted_code_as_code() -> None:
    report = make_report()  # its first fix: "Keep `encoder.attn` in FP32."
    page = html.render(report, {})
    assert "`" not in page
    assert "Keep <code>encoder.attn</code> in FP32." in page
    assert html.t("wrap it in `torch.autocast('cpu', enabled=False)` <now>") == (
        "wrap it in <code>torch.autocast(&#x27;cpu&#x27;, enabled=False)</code> &lt;now&gt;")
    assert html.t("a lone ` stays") == "a lone ` stays"


def _forward_fault_story() -> ScalerStory:
    """GradScaler's first 9 skips run together while the scale falls; 3 of them follow the forward's non-finite loss
    (README's forward_overflow: steps 0, 5 and 8), then the forward keeps overflowing."""
    loss = {0, 5, 8, 13, 16}
    skips = [ScaleEvent(s, 65536.0 / 2 ** min(s, 9), "nonfinite_loss" if s in loss else "nonfinite_grad:head")
             for s in [*range(9), 13, 16]]
    return ScalerStory(65536.0, 2.0**-3, 2.0**-3, 65536.0, 9, skips, "collapsed", "")


def test_the_calibration_count_is_the_count_the_words_give() -> None:
    sc = _forward_fault_story()
    words = SCALER_NOTES["forward_fault"](sc)
    assert "The other 6 are gradient overflows while the scale came down" in words
    line = common.calibration_line(sc)
    assert line.startswith("6 (3 more of the first 9 skips follow a non-finite loss")
    report = make_report()
    report.scaler = sc
    sc.explanation = words
    md = markdown.render(report, {})
    assert "calibration skips (the scale finding its level at the start): 6 (" in md
    assert "calibration skips: 6 (" in html.render(report, {})
    # a start with no forward fault: the count stands alone, as before
    plain = ScalerStory(65536.0, 2048.0, 2048.0, 65536.0, 5,
                        [ScaleEvent(s, 65536.0 / 2**s, "nonfinite_grad") for s in range(5)], "calibration", "")
    assert common.calibration_line(plain) == "5"


class _Kept:
    """What ``plots._png`` was handed: the figure itself, to read its artists."""

    def __init__(self) -> None:
        self.figs: list[Any] = []

    def __call__(self, fig: Any, tight: bool = True) -> bytes:
        self.figs.append(fig)
        return b"png"


def _texts(ax: Any) -> list[Any]:
    return [c for c in ax.get_children() if type(c).__name__ in ("Annotation", "Text") and c.get_text()]


def test_a_bar_below_zero_gets_a_marker_and_a_value_clear_of_the_names(monkeypatch: pytest.MonkeyPatch) -> None:
    kept = _Kept()
    monkeypatch.setattr(plots, "_png", kept)
    report = make_report()
    report.layer_steps = []
    report.layers[0].headroom_binades = -0.2  # the culprit: a sliver on a 0-34 axis
    assert plots.headroom_figure(report) == b"png"
    ax = kept.figs[0].axes[0]
    lo, hi = ax.get_xlim()
    assert lo <= -0.08 * 34.1  # room for the sliver, whatever the axis's span
    value = [a for a in _texts(ax) if "-0.2" in a.get_text()]
    assert len(value) == 1 and value[0].xy[0] == 0 and value[0].get_ha() == "left"  # right of 0, not over the names
    marks = [c for c in ax.collections if len(c.get_offsets())]
    assert any(np.allclose(c.get_offsets(), [[-0.2, 0]]) for c in marks)  # a marker at the bar's end
    assert "end of a bar below 0" in [t.get_text() for t in ax.get_legend().get_texts()]


def _history_report(ev: dict[str, Any]) -> Any:
    report = make_report()
    report.findings.append(Finding("history", "info", title=history_title(ev), module=ev.get("layer"),
                                   step=ev.get("crossed_step"), evidence=ev))
    return report


def _series(n: int, bad: int) -> dict[str, list[Any]]:
    return {"step": list(range(n)), "loss": [1.0 - 0.01 * i if i != bad else math.nan for i in range(n)],
            "grad_norm": [0.1 + 0.01 * i for i in range(n)], "scale": [65536.0] * n,
            "skipped": [1.0 if i == bad else 0.0 for i in range(n)], "lr": [1e-3] * n}


def test_the_history_chart_labels_off_the_line_and_every_line_in_a_legend(monkeypatch: pytest.MonkeyPatch) -> None:
    kept = _Kept()
    monkeypatch.setattr(plots, "_png", kept)
    n = 40
    ev = {"steps_kept": n, "first_step": 0, "fail_step": n - 1, "layer": "logits", "crossed_step": n - 1,
          "headroom": {"step": list(range(n)), "binades": [12.0 - 0.3 * i for i in range(n - 1)] + [0.0]},
          "headroom_first": 12.0, "headroom_last": 0.0, "series": _series(n, n - 1)}
    assert plots.history_figure(_history_report(ev)) == b"png"
    top, mid, _ = kept.figs[0].axes[:3]
    ran = [a for a in _texts(top) if "ran out at step 39" in a.get_text()]
    assert len(ran) == 1
    assert ran[0].xycoords == ("data", "axes fraction") and ran[0].xy[1] == 1.0  # above the plot, not on the line
    labels = [t.get_text() for t in mid.get_legend().get_texts()]
    assert labels == ["loss", "non-finite loss", "gradient norm (right axis)"]


def test_a_data_story_names_no_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring's tables of a run whose batch 30 held a NaN: every layer's output non-finite at step 30 (NaN
    headroom), the largest value 1.35 before. Older captures wrote 0 there: both read the same."""
    for old in (False, True):
        rows = []
        for s in range(31):
            for layer, a in (("body.0", 1.35), ("body.1", 1.2), ("head", 0.8)):
                bad = s == 30
                rows.append({"step": s, "layer": layer, "absmax": a, "headroom": (0.0 if old else math.nan) if bad
                             else math.log2(65504 / a), "nonfinite_frac": 0.03 if bad else 0.0})
        layers = pd.DataFrame(rows)
        steps = pd.DataFrame({"step": range(31), **{k: v for k, v in _series(31, 30).items() if k != "step"},
                              "input_numel": [512] * 31, "input_absmax": [3.0] * 31})
        told = story(steps, layers, 30, None, overflow=False)
        assert told is not None and "layer" not in told and told.get("crossed_step") is None
        assert told["nonfinite_step"] == 30
        assert told["least_headroom"] == {"layer": "body.0", "binades": pytest.approx(math.log2(65504 / 1.35))}
        title = history_title(told)
        assert "went from" not in title and "reached 0" not in title
        assert "no layer came near FP16's max (least headroom 15.6 binade(s), body.0)" in title
        assert "non-finite at step 30 with the batch, not by an overflow" in title
        # the same tables told for an overflow verdict: the non-finite step is where the headroom ran out
        over = story(steps, layers, 30, "body.0", overflow=True)
        assert over is not None and over["crossed_step"] == 30 and over["headroom_last"] == 0.0
    kept = _Kept()
    monkeypatch.setattr(plots, "_png", kept)
    told["series"] = _series(31, 30)
    plots.history_figure(_history_report(told))
    words = [a.get_text() for a in _texts(kept.figs[0].axes[0])]
    assert any("non-finite at step 30, with the batch" in w for w in words)
    assert not any("ran out" in w for w in words)


def test_the_ring_records_a_non_finite_output_as_non_finite() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, None, ring=8, quiet=True)
    for s in range(6):
        x = torch.randn(6, 4)
        if s == 4:
            x[2, 1] = float("nan")  # the batch's own NaN: no value came near FP16's max
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.after_backward(loss)
        if s != 4:
            opt.step()
        mon.after_step()
        opt.zero_grad(set_to_none=True)
    ring = mon.lookback.ring
    steps, hd = ring.layer_series("headroom")
    _, bad = ring.layer_series("nonfinite_frac")
    _, ab = ring.layer_series("absmax")
    m = ring.names.index("0")
    k = list(steps).index(4)
    assert bad[k, m] > 0 and math.isnan(hd[k, m])  # not 0: nothing overflowed
    assert 0 < ab[k, m] < 100  # its finite values stayed small
    ok = [i for i in range(len(steps)) if i != k]
    assert np.isfinite(hd[ok, m]).all() and (hd[ok, m] > 10).all()
    mon.close()
