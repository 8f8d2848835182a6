"""The lint rules as data: id, name, title, why, fix, a bad and a good snippet, and the verdicts a
finding can explain. The checks that find them are ``lint/checks.py``'s ``CHECKS`` (one function per id);
``docs/lint.md`` shows the same snippets, and ``tests/test_lint_rules.py`` checks that every bad
snippet fires its rule at ``bad_at`` and every good one does not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    title: str
    why: str
    fix: str
    bad: str
    good: str
    bad_at: tuple[int, int]
    """(line, column) of the finding in ``bad``, both from 1."""
    explains: tuple[str, ...] = ()
    """Triage verdicts a finding of this rule can explain."""


_LOOP = """\
import torch
from torch import nn

model = nn.Linear(8, 1).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
"""

def _rule(code: str, name: str, title: str, why: str, fix: str, bad: str, edit: dict[str, str], bad_at: tuple[int, int],
          explains: tuple[str, ...] = ()) -> Rule:
    """A rule whose good snippet is its bad one with ``edit`` made (each key, found once, replaced by its value):
    the fix is written as what it changes."""
    good = bad
    for old, new in edit.items():
        if bad.count(old) != 1:
            raise ValueError(f"{code}: the edit {old!r} must match the bad snippet exactly once")
        good = good.replace(old, new)
    return Rule(code, name, title, why, fix, bad, good, bad_at, explains)


def _attend(line: str) -> str:
    """An attention snippet whose masking is ``line`` (the bad and good snippets of the mask rules)."""
    return f"""\
import torch


def attend(scores, mask):
    {line}
    return torch.softmax(scores, dim=-1)


with torch.autocast("cuda", dtype=torch.float16):
    out = attend(q @ k.transpose(-2, -1), mask)
"""


_BACKWARD = _LOOP + """\
for x, y in loader:
    optimizer.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
"""
"""The AMP recipe's loop up to its backward: the scaler rules' snippets go on from there."""


RULES: tuple[Rule, ...] = (
    _rule(
        "AMP001", "clip-before-unscale", "Gradients clipped before scaler.unscale_",
        "Before unscale_ the gradients are still multiplied by the loss scale (65536 at the start), so "
        "clip_grad_norm_ compares the scaled norm with max_norm: it clips almost every step, and after "
        "unscale_ the gradients are max_norm / scale, far too small to train.",
        "Call scaler.unscale_(optimizer) right before clipping; scaler.step(optimizer) then knows the "
        "gradients are unscaled.",
        _BACKWARD + """\
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
""",
        {"    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n":
         ("    scaler.unscale_(optimizer)\n"
          "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n")},
        (12, 5), ("amp_misuse", "fp16_grad_underflow"),
    ),
    _rule(
        "AMP002", "scaler-update-skipped", "scaler.update() not called after every scaler.step()",
        "update() is what lowers the scale after an overflow and resets the scaler for the next step. "
        "Skipped on some path (a `continue` after unscale_, an update every N steps, once after the "
        "loop), the scale never backs off, and the next unscale_ or step raises 'has already been "
        "called since the last update()'.",
        "Call scaler.update() once after every scaler.step(optimizer), on every path that reached "
        "unscale_ or step; to skip a bad step, let scaler.step skip it.",
        _BACKWARD + """\
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if not torch.isfinite(norm):
        continue
    scaler.step(optimizer)
    scaler.update()
""",
        {("    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
          "    if not torch.isfinite(norm):\n"
          "        continue\n"
          "    scaler.step(optimizer)\n"):
         ("    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
          "    scaler.step(optimizer)  # skips the step itself when a gradient is inf/NaN\n")},
        (15, 9), ("amp_misuse", "fp16_grad_overflow"),
    ),
    _rule(
        "AMP003", "hook-clamps-scaled-grads", "A gradient hook clamps scaled gradients",
        "Gradient hooks run inside backward, on gradients GradScaler has multiplied by the loss scale. "
        "A clamp there cuts at max / scale in real units, so it clips nearly everything (and an inf "
        "clamped to a finite value is no longer seen as an overflow).",
        "Remove the hook; clip after scaler.unscale_(optimizer) with clip_grad_norm_ or "
        "clip_grad_value_.",
        _LOOP + """\
for p in model.parameters():
    p.register_hook(lambda g: g.clamp(-1.0, 1.0))
""",
        {("for p in model.parameters():\n"
          "    p.register_hook(lambda g: g.clamp(-1.0, 1.0))\n"):
         ("for x, y in loader:\n"
          "    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()\n"
          "    scaler.unscale_(optimizer)\n"
          "    torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)\n"
          "    scaler.step(optimizer)\n"
          "    scaler.update()\n")},
        (8, 31), ("amp_misuse", "fp16_grad_underflow"),
    ),
    _rule(
        "AMP004", "nan-to-num-grads", "nan_to_num on gradients hides GradScaler's inf",
        "GradScaler skips a step and lowers the scale when a gradient is inf or NaN. Replacing them with "
        "numbers before unscale_ (in a hook, or on p.grad) hides the overflow: the scale never backs "
        "off, and the overflowing gradients are silently zeroed or clipped into the weights.",
        "Delete the nan_to_num; GradScaler already skips non-finite steps. To inspect them, read "
        "scaler.get_scale() or the found-inf after unscale_.",
        _LOOP + """\
for p in model.parameters():
    p.register_hook(lambda g: torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0))
""",
        {("for p in model.parameters():\n"
          "    p.register_hook(lambda g: torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0))\n"):
         ("for x, y in loader:\n"
          "    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()\n"
          "    scaler.step(optimizer)  # skips the step on inf/NaN gradients and lowers the scale\n"
          "    scaler.update()\n")},
        (8, 31), ("amp_misuse",),
    ),
    _rule(
        "AMP005", "adam-on-half-params", "Adam on FP16 parameters (no FP32 master weights)",
        "After model.half() the optimizer updates FP16 weights: Adam's eps=1e-8 is 0 in FP16 (so "
        "sqrt(v) + eps can divide by 0), and an update smaller than half a weight's FP16 spacing "
        "(about 5e-4 at 1.0) rounds away: training stalls or goes NaN.",
        "Keep the model in FP32 and train with torch.autocast + GradScaler (FP32 master weights), or "
        "use bf16 autocast.",
        """\
import torch
from torch import nn

model = nn.Linear(8, 1).cuda().half()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
""",
        {"model = nn.Linear(8, 1).cuda().half()\n":
         "model = nn.Linear(8, 1).cuda()\n",
         "optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n":
         ("optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
          'scaler = torch.amp.GradScaler("cuda")\n')},
        (5, 13), ("fp16_update_swallowed",),
    ),
    _rule(
        "AMP006", "mask-outside-fp16", "Mask constant outside FP16's range (-1e9)",
        "FP16's largest magnitude is 65504. masked_fill(mask, -1e9) on FP16 scores raises 'value "
        "cannot be converted to type at::Half without overflow'; added (scores + mask * -1e9) it "
        "becomes -inf, and a fully masked row's softmax is NaN.",
        "Use torch.finfo(scores.dtype).min with masked_fill, so the value fits whatever the dtype.",
        _attend("scores = scores.masked_fill(mask == 0, -1e9)"),
        {"    scores = scores.masked_fill(mask == 0, -1e9)\n":
         "    scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)\n"},
        (5, 44), ("fp16_forward_overflow", "model_bug"),
    ),
    _rule(
        "AMP007", "mask-too-weak", "Mask constant -1e4 may not mask",
        "-1e4 is the FP16-safe compromise, but it is not always a mask: scores below -1e4 (unscaled "
        "attention, a large position bias) keep their weight next to the 'masked' entries "
        "(transformers#14859, fixed by PR#17306).",
        "Use masked_fill with torch.finfo(scores.dtype).min (FP16's -65504, FP32's -3.4e38).",
        _attend("scores = scores + (1.0 - mask) * -10000.0"),
        {"    scores = scores + (1.0 - mask) * -10000.0\n":
         "    scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)\n"},
        (5, 38), ("model_bug",),
    ),
    _rule(
        "AMP008", "finfo-min-added", "torch.finfo(torch.float16).min added to scores",
        "finfo(float16).min is -65504, the end of FP16's range: added to a score below -16 the sum is "
        "-inf, two such masks add to -inf, and a row of -inf makes softmax NaN.",
        "Fill with it instead of adding it (scores.masked_fill(mask, torch.finfo(scores.dtype).min)), or "
        "clamp the sum: torch.clamp(scores + mask, min=torch.finfo(scores.dtype).min).",
        _attend("scores = scores + (~mask) * torch.finfo(torch.float16).min"),
        {"    scores = scores + (~mask) * torch.finfo(torch.float16).min\n":
         "    scores = scores.masked_fill(~mask, torch.finfo(torch.float16).min)\n"},
        (5, 33), ("fp16_forward_overflow",),
    ),
    _rule(
        "AMP009", "hand-written-softmax", "Hand-written softmax",
        "exp(x) overflows FP16 for x above 11.1 (and FP32 above 88.7): x.exp() / x.exp().sum() is "
        "inf / inf = NaN. torch.softmax subtracts the maximum first, and autocast runs it in FP32.",
        "Use torch.softmax(x, dim) (or log_softmax for a log-probability).",
        """\
import torch


def probs(x):
    return x.exp() / x.exp().sum(dim=-1, keepdim=True)


with torch.autocast("cuda", dtype=torch.float16):
    p = probs(model(x))
""",
        {"    return x.exp() / x.exp().sum(dim=-1, keepdim=True)\n":
         "    return torch.softmax(x, dim=-1)\n"},
        (5, 12), ("fp16_forward_overflow",),
    ),
    _rule(
        "AMP010", "log-of-softmax", "log of a softmax or sigmoid",
        "A probability below FP16's smallest value (6e-8) is 0, and log(0) is -inf: the loss goes inf, "
        "the gradients NaN. log_softmax and logsigmoid compute the log directly and never leave the "
        "range.",
        "Use torch.log_softmax(x, dim) / F.logsigmoid(x) (or F.cross_entropy on the logits).",
        """\
import torch


def nll(logits, target):
    logp = torch.log(torch.softmax(logits, dim=-1))
    return -logp.gather(1, target[:, None]).mean()


with torch.autocast("cuda", dtype=torch.float16):
    loss = nll(model(x), y)
""",
        {"    logp = torch.log(torch.softmax(logits, dim=-1))\n":
         "    logp = torch.log_softmax(logits, dim=-1)\n"},
        (5, 12), ("fp16_forward_overflow",),
    ),
    _rule(
        "AMP011", "eps-below-fp16", "An epsilon that FP16 rounds to 0, under autocast",
        "1e-8 (or 1e-10, 1e-12) is below FP16's smallest subnormal 6e-8: on an FP16 tensor x + 1e-8 "
        "is x, so log(x + 1e-8), sqrt(x + 1e-8) and y / (x + 1e-8) still reach log(0), 0 or a "
        "division by 0.",
        "Compute the guarded op in FP32 (x.float()) or use an epsilon FP16 keeps (1e-5 or more).",
        """\
import torch


def poisson_nll(model, x, t):
    with torch.autocast("cuda", dtype=torch.float16):
        rate = torch.relu(model(x))
        return (rate - t * torch.log(rate + 1e-8)).mean()
""",
        {"        return (rate - t * torch.log(rate + 1e-8)).mean()\n":
         "    return (rate.float() - t * torch.log(rate.float() + 1e-8)).mean()\n"},
        (7, 38), ("fp16_forward_overflow",),
    ),
    _rule(
        "AMP012", "variance-in-fp16", "Variance or standard deviation in FP16 autocast",
        "autocast runs var and std in the input's dtype (they are not on its FP32 list, unlike sum and "
        "layer_norm): the squared deviations overflow FP16 once |x - mean| passes 256, and the result "
        "is inf.",
        "Compute it on x.float() (x.float().var(dim)), or normalise with nn.LayerNorm, which autocast "
        "runs in FP32.",
        """\
import torch


def normalise(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        h = model(x)
        return (h - h.mean(-1, keepdim=True)) / h.std(-1, keepdim=True)
""",
        {"        h = model(x)\n":
         "        h = model(x).float()\n"},
        (7, 49), ("fp16_forward_overflow",),
    ),
    _rule(
        "AMP013", "scaler-state-not-saved", "Checkpoint without the GradScaler's state",
        "A run resumed from this checkpoint starts a new scaler at 65536: it skips steps while it "
        "calibrates again, and a run that had settled at a low scale overflows right after resuming.",
        "Save scaler.state_dict() beside the optimizer's and load it with scaler.load_state_dict().",
        _LOOP + """\
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "ckpt.pt")
""",
        {'torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "ckpt.pt")\n':
         ('torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),\n'
          '            "scaler": scaler.state_dict()}, "ckpt.pt")\n')},
        (7, 12), ("not_reproduced",),
    ),
    _rule(
        "AMP014", "autocast-wrong-device", "autocast for another device than the model's",
        "autocast changes only the ops of its device_type: torch.autocast('cpu') around a CUDA model "
        "(or torch.cuda.amp.autocast around a CPU model) runs everything in FP32, while a GradScaler "
        "still scales the loss.",
        "Give autocast the model's device: torch.autocast(device_type=device.type, dtype=...).",
        _LOOP + """\
for x, y in loader:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x.cuda()), y.cuda())
""",
        {'    with torch.autocast("cpu", dtype=torch.bfloat16):\n':
         '    with torch.autocast("cuda", dtype=torch.float16):\n'},
        (8, 10), ("amp_misuse",),
    ),
    _rule(
        "AMP015", "backward-without-scale", "loss.backward() with scaler.step()",
        "scaler.step(optimizer) unscales first: it divides the gradients by the scale. Made by "
        "loss.backward() they were never multiplied, so they arrive 65536 times too small and "
        "underflow.",
        "Backpropagate the scaled loss: scaler.scale(loss).backward().",
        _LOOP + """\
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    scaler.step(optimizer)
    scaler.update()
""",
        {"    loss.backward()\n":
         "    scaler.scale(loss).backward()\n"},
        (10, 5), ("fp16_grad_underflow", "amp_misuse"),
    ),
)

BY_CODE: dict[str, Rule] = {r.code: r for r in RULES}
