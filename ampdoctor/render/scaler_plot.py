"""The figure of ``ampdoctor scaler --plot``: GradScaler's scale (log2 axis, skips marked) and the loss against step,
drawn from a step log's digest (``judge.log_digest.LogDigest``'s envelopes). Nothing here prints or touches files."""

from __future__ import annotations

import io

import numpy as np

from ampdoctor.judge.log_digest import Envelope, LogDigest


def _series(env: Envelope) -> tuple[list[float], list[float]]:
    """An envelope as one line: each bucket's minimum then its maximum at its first step (the series itself
    when nothing was merged)."""
    if env.width == 1:
        return env.x.tolist(), env.lo.tolist()
    return np.repeat(env.x, 2).tolist(), np.stack([env.lo, env.hi], axis=1).ravel().tolist()


def scaler_png(dig: LogDigest, pattern: str | None) -> bytes:
    """PNG bytes: the scale on top (titled with the history's ``pattern``), the loss below, skipped steps marked in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    sk_steps, sk_scales = _series(dig.skip_env)
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    try:
        if dig.has_scale:
            xs, ys = _series(dig.scale_env)
            ax1.step(xs, ys, where="post", color="tab:blue", label="scaler_scale")
            ax1.set_yscale("log", base=2)
            ax1.scatter(sk_steps, sk_scales, color="tab:red", marker="x", zorder=3, label="skipped")
            ax1.set_title(f"GradScaler scale: {pattern}" if pattern else "GradScaler scale")
        else:
            ax1.text(0.5, 0.5, "no GradScaler in this run", ha="center", va="center", transform=ax1.transAxes)
        ax1.set_ylabel("scale (log2)")
        ax1.legend(loc="best")
        env = dig.loss_env
        if env.x.size:
            xs, ys = _series(env)
            ax2.plot(xs, ys, color="tab:green", label="loss")
            lo, hi = float(env.lo.min()), float(env.hi.max())
            if lo > 0 and hi / max(lo, 1e-300) > 1e3:
                ax2.set_yscale("log")
        for s in dict.fromkeys(dig.skip_env.x.tolist()):
            ax2.axvline(s, color="tab:red", alpha=0.3, linewidth=1)
        ax2.set_xlabel("step")
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax2.set_ylabel("loss")
        ax2.legend(loc="best")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        return buf.getvalue()
    finally:
        plt.close(fig)
