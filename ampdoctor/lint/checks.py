"""The checks behind the rules: one function per rule, over one file's facts, yielding (node, message);
``CHECKS`` maps each rule's id to its check. The checks live by what they read: ``checks_recipe`` (GradScaler's
recipe), ``checks_masks`` (mask constants), ``checks_numerics`` (precision and numerics); what they share is
``check_context``.

A check yields only what it can decide from the text. Where a name cannot be followed (a scaler
passed in from another file, a dtype chosen at run time) it yields nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ampdoctor.lint.check_context import Ctx, Hit
from ampdoctor.lint.checks_masks import finfo_min_added, mask_overflows, mask_too_weak
from ampdoctor.lint.checks_numerics import (
    adam_on_half,
    autocast_device,
    hand_softmax,
    log_of_softmax,
    tiny_eps,
    variance_in_autocast,
)
from ampdoctor.lint.checks_recipe import (
    backward_unscaled,
    clip_before_unscale,
    hook_clamps,
    nan_to_num_grads,
    scaler_not_saved,
    update_skipped,
)

CHECKS: dict[str, Callable[[Ctx], Iterator[Hit]]] = {
    "AMP001": clip_before_unscale,
    "AMP002": update_skipped,
    "AMP003": hook_clamps,
    "AMP004": nan_to_num_grads,
    "AMP005": adam_on_half,
    "AMP006": mask_overflows,
    "AMP007": mask_too_weak,
    "AMP008": finfo_min_added,
    "AMP009": hand_softmax,
    "AMP010": log_of_softmax,
    "AMP011": tiny_eps,
    "AMP012": variance_in_autocast,
    "AMP013": scaler_not_saved,
    "AMP014": autocast_device,
    "AMP015": backward_unscaled,
}

__all__ = ["CHECKS"]
