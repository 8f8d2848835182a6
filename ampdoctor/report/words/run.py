"""The lines about the run itself: what ran (``what_ran``, the line under a report's title), a stage that stopped
early (``stage_stopped``), a replay's gradient hooks (``hooks_kept``) and its GradScaler (``replay_scaler``)."""

from __future__ import annotations

from ampdoctor.fmt import pow2
from ampdoctor.report.words.common import Facts


def hooks_kept(kept: list[str], lost: list[str], total: int) -> list[str]:
    """The replay's notes on the run's gradient hooks (the capture's ``user_hooks``): those the spec's model registers
    again are kept, the others are listed as not re-created (a capture keeps no code)."""
    out = []
    if kept:
        out.append(f"the run's model carried {total} gradient hook(s); the replay keeps {len(kept)} (the spec's model "
                   "registers them): " + "; ".join(kept[:5]) + (" ..." if len(kept) > 5 else ""))
    if lost:
        out.append(f"{len(lost)} of the run's gradient hook(s) were not re-created in the replay (the spec's model does not "
                   "register them; a hook is code, which a capture does not keep): " + "; ".join(lost[:5])
                   + (" ..." if len(lost) > 5 else ""))
    return out


def stage_stopped(what: str, step: int) -> str:
    """Why a stage stopped early (``what``: 'loss' or 'weights'), at the run's ``step``."""
    return f"{what} became non-finite at step {step}"


def replay_scaler(scale: float, steps: int, manifest: Facts) -> str:
    """GradScaler's story of a replay from a capture: where it started, and where the run's own scale history is
    (the capture's ``step_log``; a capture without one says so, and how to keep one)."""
    s = f"The replay started from the run's captured scale {pow2(scale)} and ran {steps} step(s)."
    log = manifest.get("step_log")
    if log:
        return s + f" The run's whole scale history is in its step log: `ampdoctor scaler {log}`."
    if "step_log" in manifest:
        return s + (" The run kept no step log, so its scale history is not known here: Monitor(log='steps.csv') "
                    "keeps one for `ampdoctor scaler`.")
    return s + " If the run kept a step log (Monitor(log=...)), `ampdoctor scaler` on it tells the run's whole scale history."


def what_ran(tool: str, config: Facts, steps: int | None) -> str:
    """The line under a report's title: the command, the target, how many steps, from where.
    'ampdoctor triage of forward_overflow.py: the amp stage against FP32, 50 steps from the initial weights'."""
    spec = str(config.get("spec") or "")
    name = spec.replace("\\", "/").rsplit("/", 1)[-1] if spec else ""
    head = f"{tool} of {name}" if name else tool
    target = config.get("target")
    what = [f"the {target} stage against FP32" if target else ""]
    if steps:
        what.append(f"{steps:,} step{'s' if steps != 1 else ''} from {config.get('start') or 'the initial weights'}")
    cap = config.get("from_capture")
    if cap:
        what.append(f"replayed from the capture {cap}")
    elif config.get("checkpoint"):
        what.append(f"from the checkpoint {config['checkpoint']}")
    body = ", ".join(w for w in what if w)
    return f"{head}: {body}" if body else head
