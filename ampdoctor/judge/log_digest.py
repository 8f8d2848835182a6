"""One streaming pass over a step log (``LogDigest``): the scale history (``scale_tracker.ScaleTracker``), the
runs of skips (``LedgerTracker``), the rolling skip rate (``RateTracker``) and the envelope of a column for its
plot (``Envelope``), in bounded memory however long the log."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ampdoctor.judge.scale_tracker import ScaleTracker


@dataclass
class RunSummary:
    """One run of consecutive skipped steps, as the ledger shows it: its span, its reasons (each once), its scale."""

    start: int
    end: int
    length: int
    reasons: list[str]
    scale: float | None


class LedgerTracker:
    """``skip_ledger``'s figures for a log read in chunks: counts, reasons, runs (the first ``keep`` in full)."""

    def __init__(self, keep: int = 20) -> None:
        self.keep = keep
        self.total = 0
        self.count = 0
        self.by_reason: Counter[str] = Counter()
        self.runs: list[RunSummary] = []
        self.n_runs = 0
        self.longest = 0
        self._open = 0
        """Length of the run still open at the end of what was fed (0: the last row was applied)."""
        self._open_tracked = False

    def feed(self, steps: np.ndarray, skipped: np.ndarray, reasons: np.ndarray, scales: np.ndarray | None) -> None:
        m = len(steps)
        if m == 0:
            return
        self.total += m
        li = np.flatnonzero(skipped)
        if not li.size:
            self._open = 0
            return
        rs = reasons[li].astype(str)
        vals, first_at, counts = np.unique(rs, return_index=True, return_counts=True)
        for k in np.argsort(first_at, kind="stable").tolist():  # in the order they first appear, as skip_ledger counts
            self.by_reason[str(vals[k]) or "(no reason logged)"] += int(counts[k])
        self.count += int(li.size)
        new = np.ones(li.size, dtype=bool)
        new[1:] = np.diff(li) > 1
        starts = np.flatnonzero(new)
        lengths = np.diff(np.append(starts, li.size))
        runs_len = lengths.copy()
        cont = bool(self._open and li[0] == 0)  # the first piece continues the run the last chunk ended in
        if cont:
            runs_len[0] += self._open
            if self._open_tracked:
                r, ln = self.runs[-1], int(lengths[0])
                r.end = int(steps[li[ln - 1]])
                r.length += ln
                r.reasons.extend(x for x in dict.fromkeys(rs[:ln].tolist()) if x not in r.reasons)
        self.longest = max(self.longest, int(runs_len.max()))
        fresh = starts.size - int(cont)
        self.n_runs += fresh
        head = slice(int(cont), int(cont) + max(0, self.keep - len(self.runs)))
        for s0, ln in zip(starts[head].tolist(), lengths[head].tolist(), strict=True):
            self.runs.append(RunSummary(int(steps[li[s0]]), int(steps[li[s0 + ln - 1]]), ln,
                                        list(dict.fromkeys(rs[s0:s0 + ln].tolist())),
                                        None if scales is None else float(scales[li[s0]])))
        if fresh:
            self._open_tracked = self.n_runs <= self.keep
        run_len = int(runs_len[-1])
        self._open = run_len if skipped[-1] else 0

    @property
    def rate(self) -> float:
        return self.count / self.total if self.total else 0.0

    def reasons_by_count(self) -> dict[str, int]:
        return dict(sorted(self.by_reason.items(), key=lambda kv: -kv[1]))


class RateTracker:
    """``rolling_skip_rate`` read out as the scaler report does (final, peak and where, steps above the alert rate),
    for a log read in chunks; the skips of the last ``window`` steps are kept (8 bytes each)."""

    def __init__(self, window: int, alert_rate: float) -> None:
        self.window = window
        self.alert = alert_rate
        self.s0 = min(window, 100)
        self.n = 0
        self.skips = np.zeros(0, dtype=np.int64)
        self.dropped = 0
        self.total_skips = 0
        self.final = 0.0
        # (peak, step at the peak, steps above the alert rate) judged from row s0, and from row 0
        self.from_s0: tuple[float, int, int] | None = None
        self.from_0: tuple[float, int, int] | None = None
        self.step_s0 = 0
        self.first_step = 0

    def feed(self, steps: np.ndarray, skipped: np.ndarray) -> None:
        m = len(steps)
        if m == 0:
            return
        o = self.n
        if o == 0:
            self.first_step = int(steps[0])
        g = np.arange(o, o + m, dtype=np.int64)
        self.skips = np.concatenate([self.skips, g[skipped]])
        c_i = self.total_skips + np.cumsum(skipped, dtype=np.int64)
        c_lo = self.dropped + np.searchsorted(self.skips, g + 1 - self.window, side="left")
        rates = (c_i - c_lo) / np.minimum(g + 1, self.window)
        self.total_skips = int(c_i[-1])
        self.final = float(rates[-1])
        self.from_0 = self._merge(self.from_0, rates, steps)
        if o + m > self.s0:
            lo = max(0, self.s0 - o)
            if lo < m and o + lo == self.s0:
                self.step_s0 = int(steps[lo])
            self.from_s0 = self._merge(self.from_s0, rates[lo:], steps[lo:])
        keep = np.searchsorted(self.skips, o + m - self.window, side="left")
        self.dropped += int(keep)
        self.skips = self.skips[keep:]
        self.n = o + m

    def _merge(self, acc: tuple[float, int, int] | None, rates: np.ndarray, steps: np.ndarray) -> tuple[float, int, int]:
        if not rates.size:
            return acc  # type: ignore[return-value]
        k = int(np.argmax(rates))
        peak, at, over = float(rates[k]), int(steps[k]), int((rates > self.alert).sum())
        if acc is None:
            return peak, at, over
        return (acc[0], acc[1], acc[2] + over) if acc[0] >= peak else (peak, at, acc[2] + over)

    def summary(self) -> tuple[float, int, float, int, int]:
        """(final rate, the first judged step, peak, step at the peak, steps above the alert rate)."""
        if self.n > self.s0 and self.from_s0 is not None:
            return self.final, self.step_s0, *self.from_s0
        assert self.from_0 is not None
        return self.final, self.first_step, *self.from_0


class Envelope:
    """At most about ``2 * cap`` points of a long series for a plot: consecutive points in buckets of ``width``
    (1, 2, 4, ...: the width doubles when the buckets pass ``2 * cap``), each bucket its first x and its true
    minimum and maximum y. With width 1 the points are the series itself."""

    def __init__(self, cap: int = 4000) -> None:
        self.cap = cap
        self.width = 1
        self.n = 0
        self.ids = np.zeros(0, dtype=np.int64)
        self.x = np.zeros(0, dtype=np.float64)
        self.lo = np.zeros(0, dtype=np.float64)
        self.hi = np.zeros(0, dtype=np.float64)

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        m = len(x)
        if m == 0:
            return
        ids = (self.n + np.arange(m, dtype=np.int64)) // self.width
        self.n += m
        self._put(ids, np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), np.asarray(y, dtype=np.float64))
        while len(self.ids) > 2 * self.cap:
            self.width *= 2
            ids, x0, lo, hi = self.ids // 2, self.x, self.lo, self.hi
            self.ids = np.zeros(0, dtype=np.int64)
            self.x = self.lo = self.hi = np.zeros(0, dtype=np.float64)
            self._put(ids, x0, lo, hi)

    def _put(self, ids: np.ndarray, x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        if self.ids.size and ids[0] == self.ids[-1]:  # the open bucket continues
            ids = np.concatenate([self.ids[-1:], ids])
            x = np.concatenate([self.x[-1:], x])
            lo = np.concatenate([self.lo[-1:], lo])
            hi = np.concatenate([self.hi[-1:], hi])
            self.ids, self.x, self.lo, self.hi = self.ids[:-1], self.x[:-1], self.lo[:-1], self.hi[:-1]
        starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
        self.ids = np.concatenate([self.ids, ids[starts]])
        self.x = np.concatenate([self.x, x[starts]])
        self.lo = np.concatenate([self.lo, np.minimum.reduceat(lo, starts)])
        self.hi = np.concatenate([self.hi, np.maximum.reduceat(hi, starts)])


class LogDigest:
    """What ``ampdoctor scaler`` reports about one step log, taken from its frames in order (one frame, or a block
    at a time): the scale diagnosis, the skip ledger, the rolling skip rate, the applied non-finite steps and the
    plot's series, in memory that does not grow with the rows.

    ``first_scale`` is the log's first non-empty ``scaler_scale`` (the scale of the rows before it, as
    ``StepLog.scales`` fills them), None when the column is empty throughout (a run without GradScaler).
    An empty cell later takes the scale of the row before. A scale that is zero, negative or infinite stops the
    digest: ``bad`` is its (step, value).
    """

    def __init__(self, window: int, alert_rate: float, first_scale: float | None, *, keep_runs: int = 20,
                 plot: bool = False) -> None:
        self.has_scale = first_scale is not None
        self.scale = ScaleTracker() if self.has_scale else None
        self.ledger = LedgerTracker(keep_runs)
        self.rates = RateTracker(window, alert_rate)
        self.carry = first_scale
        self.n = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.applied = 0
        self.first_applied: tuple[int, str] | None = None
        self.bad: tuple[int, float] | None = None
        self.plot = plot
        self.scale_env, self.skip_env, self.loss_env = Envelope(), Envelope(), Envelope()

    def feed(self, frame: Any) -> bool:
        """Take one frame (typed as ``read_step_log`` types it); False once a bad scale stopped the digest."""
        if self.bad is not None:
            return False
        st = frame["step"].to_numpy(dtype=np.int64)
        if not st.size:
            return True
        sk = frame["skipped"].to_numpy(dtype=bool)
        reasons = frame["skip_reason"].to_numpy(dtype=object)
        sc: np.ndarray | None = None
        if self.has_scale:
            raw = frame["scaler_scale"].to_numpy(dtype=np.float64)
            if np.isnan(raw).any():
                ffilled = frame["scaler_scale"].astype("float64").ffill().to_numpy(dtype=np.float64)
                raw = np.where(np.isnan(ffilled), self.carry, ffilled)
            sc = raw
            self.carry = float(sc[-1])
            bad = np.flatnonzero(~((sc > 0) & np.isfinite(sc)))
            if bad.size:
                self.bad = (int(st[bad[0]]), float(sc[bad[0]]))
                return False
        if self.first_step is None:
            self.first_step = int(st[0])
        self.last_step = int(st[-1])
        self.n += st.size
        if self.scale is not None and sc is not None:
            self.scale.feed(sc, sk, st)
        self.ledger.feed(st, sk, reasons, sc)
        self.rates.feed(st, sk)
        ok = ~sk
        if ok.any():
            applied = ok & np.char.startswith(reasons.astype(str), "applied:")
            k = np.flatnonzero(applied)
            if k.size:
                self.applied += int(k.size)
                if self.first_applied is None:
                    self.first_applied = (int(st[k[0]]), str(reasons[k[0]]))
        if self.plot:
            x = st.astype(np.float64)
            if sc is not None:
                self.scale_env.add(x, sc)
                self.skip_env.add(x[sk], sc[sk])
            else:
                self.skip_env.add(x[sk], np.zeros(int(sk.sum())))
            loss = frame["loss"].to_numpy(dtype=np.float64)
            fin = np.isfinite(loss)
            self.loss_env.add(x[fin], loss[fin])
        return True
