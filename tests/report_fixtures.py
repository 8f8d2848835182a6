"""Hand-made Reports for renderer tests: deterministic (explicit environment, no timestamps)."""

from __future__ import annotations

from ampdoctor.report.model import (
    CAUSES,
    Finding,
    LayerRow,
    LayerStep,
    Report,
    ScaleEvent,
    ScalerStory,
    StageSummary,
    Verdict,
)

ENV = {
    "ampdoctor": "0.0.0-test", "torch": "2.x-test", "python": "3.x", "os": "TestOS 1 (x86_64)", "cuda": "12.4",
    "device": "cuda:0", "device_name": "Test GPU", "compute_capability": "8.0", "fp16_supported": True,
    "bf16_supported": True, "tf32_matmul": False, "tf32_cudnn": True,
    "command": "ampdoctor triage model_spec.py --steps 12 --report report.md",
}

CONFIG = {"steps": 12, "target": "amp", "stages": None, "device": "auto", "seed": 7, "max_norm": 1.0,
          "init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
          "spec": "model_spec.py"}


def make_report(cause: str = "fp16_forward_overflow") -> Report:
    assert cause in CAUSES
    n = 12
    scales: list[float | None] = [65536.0 / 2 ** min(i, 5) for i in range(n)]
    skipped = [0, 1, 2, 3, 4]
    fp32 = StageSummary("fp32", n, None, [], None, 0.61, None, [2.0 - 0.12 * i for i in range(n)],
                        [None] * n, [1.5 - 0.05 * i for i in range(n)])
    fp16 = StageSummary("fp16", 1, 0, [0], None, float("nan"), 2.0, [float("nan")], [None], [float("nan")],
                        stopped="loss became non-finite at step 0")
    amp = StageSummary("amp", n, 0, skipped, 2048.0, 0.75, 0.61,
                       [float("nan") if i in skipped else 2.0 - 0.1 * i for i in range(n)], scales,
                       [float("inf") if i in skipped else 1.4 - 0.05 * i for i in range(n)])
    layers = [
        LayerRow("encoder.attn", "activation", 90210.5, 1.0, 0.0, 0.25, -0.46, 0),
        LayerRow(f"encoder.layer{1}.weight", "param_grad", 3.5e-6, 0.0, 0.42, 0.0, 34.1, None),
    ] + [LayerRow(f"decoder.block{i}.mlp", "activation", 1000.0 * (i + 1), 0.0, 0.0, 0.0, 6.0 - i / 4, None) for i in range(6)]
    layer_steps = [LayerStep(m, k, s, of if s < 5 else 0.0, 0.0, nf if s < 5 else 0.0, 0.1 * (s % 3), 9e4 if of else 40.0)
                   for (m, k, of, nf) in (("encoder.attn", "activation", 0.01, 0.25), ("encoder.mlp", "activation", 0.0, 0.0),
                                          ("head.weight", "param_grad", 0.0, 1.0))
                   for s in range(n)]
    story = ScalerStory(65536.0, 2048.0, 2048.0, 65536.0, 5,
                        [ScaleEvent(s, 65536.0 / 2**s, "nonfinite_loss" if s == 0 else "nonfinite_grad") for s in skipped],
                        "collapsed", "the scale fell 5 times in a row: the forward overflows FP16 whatever the scale")
    findings = [
        Finding(cause, "error", "encoder.attn overflows FP16 in the forward pass", "amp", "encoder.attn", 0,
                {"fp32_absmax": 90210.5, "fp16_max": 65504.0, "fp32_recheck_finite": True}, "Run encoder.attn in FP32."),
        Finding("calibration_skips", "warning", "5 steps skipped while GradScaler calibrated", "amp",
                fix="normal at the start; pass --init-scale 2048 to skip it"),
    ]
    healthy = cause == "healthy"
    return Report(
        verdict=Verdict(cause, None if healthy else "encoder.attn", None if healthy else 0, None if healthy else "amp",
                        f"Hand-made verdict for {cause} | with a pipe.", "cuda:0"),
        stages=[fp32, fp16, amp], findings=[] if healthy else findings, layers=[] if healthy else layers,
        scaler=story, fixes=[] if healthy else ["Keep `encoder.attn` in FP32.", "Or train in bf16: rerun with --target bf16."],
        environment=dict(ENV), config=dict(CONFIG),
        notes=["the dataloader yields 4 batch(es); they were cycled to make 12 steps"], layer_steps=layer_steps,
    )
