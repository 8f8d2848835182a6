"""Frozen, validated configuration of a triage run."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ampdoctor.errors import UsageError

STAGES = ("fp32", "fp16", "amp", "bf16", "compile")
MAX_STEPS = 10**7
"""The most optimizer steps a triage takes (--steps x --accumulate micro-batches): tens to thousands tell
the story; more would run for days (or, for 12 digits, never end) rather than fail."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""The seeds ``torch.manual_seed`` takes."""
TARGETS = ("amp", "fp16", "bf16")
AUTOCAST_POLICIES = ("auto", "native", "cuda")


@dataclass(frozen=True)
class TriageConfig:
    """Options of ``ampdoctor triage``; every field maps to a CLI option of the same name."""

    steps: int = 50
    """Optimizer steps per stage; the dataloader is cycled when it is shorter."""
    target: str = "amp"
    """The configuration the user trains with: amp (autocast fp16 + GradScaler), fp16 (pure half
    weights and optimizer) or bf16 (autocast bf16, no scaler). The verdict is about it."""
    stages: tuple[str, ...] | None = None
    """Stages to run; None means fp32, fp16, amp, plus bf16 when it is the target."""
    device: str = "auto"
    """auto (cuda when available), cpu, cuda or cuda:N."""
    seed: int = 0
    """RNG seed set before every stage."""
    max_norm: float | None = None
    """Global L2 gradient clipping threshold, applied in every stage; None: no clipping."""
    accumulate: int = 1
    """Gradient accumulation: micro-batches per optimizer step (each loss divided by it, as loops do)."""
    init_scale: float = 2.0**16
    """GradScaler initial scale."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    autocast_policy: str = "auto"
    """Which ops autocast casts: auto (the device's own; a capture of a CUDA run replayed on the CPU: cuda), native
    or cuda (CUDA's op policy emulated on the CPU: ``ladder.policy``)."""
    fp8_recipe: str = "tensorwise"
    """The FP8 rung's torchao recipe (``--target fp8``): tensorwise, rowwise or rowwise_with_gw_hp."""
    batch_keys: str | None = None
    """``IN[,IN...]:TARGET``: the batch fields that are the model's inputs and the target (``input.batches.BatchKeys``);
    None: the rule of docs/spec-format.md."""
    compile: bool = False
    """Also run the target's precision with the model under ``torch.compile`` (the ``compile`` rung): a failure only
    the compiled model has is bisected over the backends (``engine.compiled``)."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.steps < 1:
            raise UsageError(f"--steps must be at least 1 (got {self.steps})")
        if self.accumulate < 1:
            raise UsageError(f"--accumulate must be at least 1 (got {self.accumulate})")
        if self.target not in TARGETS:
            raise UsageError(f"--target must be one of {', '.join(TARGETS)} (got {self.target!r})")
        if self.autocast_policy not in AUTOCAST_POLICIES:
            raise UsageError(f"--autocast-policy must be one of {', '.join(AUTOCAST_POLICIES)} (got {self.autocast_policy!r})")
        if self.stages is not None:
            bad = [s for s in self.stages if s not in STAGES]
            if bad:
                raise UsageError(f"unknown stage {bad[0]!r}; stages are {', '.join(STAGES)}")
        if self.init_scale <= 0:
            raise UsageError("--init-scale must be positive, e.g. --init-scale 1024")
        if not 0 < self.backoff_factor < 1:
            raise UsageError("--backoff-factor must be in (0, 1), e.g. 0.5")
        if self.growth_interval < 1:
            raise UsageError("--growth-interval must be at least 1")
        if self.batch_keys is not None:
            from ampdoctor.input.batches import BatchKeys

            BatchKeys.parse(self.batch_keys)  # a malformed value is one line now, not at the first batch
        if self.max_norm is not None and self.max_norm <= 0:
            raise UsageError("--max-norm must be positive, e.g. --max-norm 1.0")
        if self.steps > MAX_STEPS:
            raise UsageError(f"--steps {_short(self.steps)} is more than a triage takes (at most {MAX_STEPS:,}); it needs "
                             "tens to thousands of steps, e.g. --steps 200")
        if self.steps * self.accumulate > MAX_STEPS:
            raise UsageError(f"--steps {self.steps} x --accumulate {_short(self.accumulate)} is more micro-batches than a "
                             f"triage takes (at most {MAX_STEPS:,}); lower --accumulate or --steps")
        if not SEED_MIN <= self.seed <= SEED_MAX:
            raise UsageError(f"--seed {_short(self.seed)} is outside what torch.manual_seed takes ({SEED_MIN} to {SEED_MAX}); "
                             "give a smaller seed, e.g. --seed 0")
        if self.growth_interval > 2**31 - 1:
            raise UsageError(f"--growth-interval {_short(self.growth_interval)} is more than GradScaler keeps (at most "
                             f"{2**31 - 1}); e.g. --growth-interval 2000")

    def stage_list(self) -> tuple[str, ...]:
        """Stages in run order; fp32 always runs first because every verdict compares with it."""
        wanted = self.stages or ("fp32", "fp16", "amp") + (("bf16",) if self.target == "bf16" else ())
        want = set(wanted) | {"fp32", self.target} | ({"compile"} if self.compile else set())
        return tuple(s for s in STAGES if s in want)


_KIND = {"compile": bool, "accumulate": int, "steps": int, "seed": int, "growth_interval": int, "target": str, "device": str, "batch_keys": str,
         "autocast_policy": str,
         "fp8_recipe": str, "max_norm": float, "init_scale": float, "growth_factor": float, "backoff_factor": float}
_EXAMPLE = {"compile": "true", "accumulate": "4", "steps": "50", "seed": "0", "growth_interval": "2000", "target": '"amp"', "device": '"cpu"', "batch_keys": '"image:label"',
            "autocast_policy": '"cuda"', "fp8_recipe": '"rowwise"',
            "max_norm": "1.0", "init_scale": "65536", "growth_factor": "2.0", "backoff_factor": "0.5"}


def _check_types(cfg: TriageConfig) -> None:
    """Values from TRIAGE_OPTIONS arrive untyped: refuse "ten" for steps with one line, not a TypeError."""
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.name == "stages":
            if v is not None and not (isinstance(v, tuple) and all(isinstance(s, str) for s in v)):
                raise UsageError(f"stages must be stage names such as \"fp32,amp\" (got {v!r})")
            continue
        kind = _KIND.get(f.name)
        if kind is None or (v is None and f.name in ("max_norm", "batch_keys")):
            continue
        if kind is bool:
            ok = isinstance(v, bool)
        elif kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif kind is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        else:
            ok = isinstance(v, str)
        if not ok:
            what = {bool: "true or false", int: "a whole number", float: "a finite number", str: "a string"}[kind]
            raise UsageError(f"{_option(f.name)} must be {what} (got {v!r}); in TRIAGE_OPTIONS write "
                             f"\"{f.name}\": {_EXAMPLE[f.name]}")


def _short(n: int) -> str:
    """A whole number as typed, cut when it is very long (a 40-digit --steps is not printed whole)."""
    t = str(n)
    return t if len(t) <= 24 else f"{t[:12]}...({len(t)} digits)"


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")
