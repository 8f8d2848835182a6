"""The judge's shared thresholds, each once: the rules, the data scan and the scale history read them from here."""

from __future__ import annotations

OUTLIER_RATIO = 1e3
"""Three orders of magnitude: a batch whose largest value is 1000x the median batch's is an outlier (the rules), a
value 1000x its field's typical magnitude is one (the data scan), an update whose gradient norm is 1000x the typical
one has exploded (``scaler.EXPLODE_RATIO``)."""
FLUSH_THRESHOLD = 0.5
"""A parameter whose FP32-non-zero gradient elements are more than half zero in FP16 underflows."""
STALL_RATIO = 0.5
"""The target stalls when it makes less than half of FP32's loss progress; a parameter is frozen when its weights move
less than half as far as in FP32."""
SKIP_RATE_ALERT = 0.05
"""Skip rate after calibration above which GradScaler is failing (5% of the steps)."""
MIN_STALL_STEPS = 8
"""Fewer steps than this are too few to call a stall (per-batch noise dominates)."""
