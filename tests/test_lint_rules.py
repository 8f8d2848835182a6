"""The lint rules on real snippets: every rule's bad snippet fires at its line and column and its good
one does not, and the data flow (names followed across functions, branches, loops) decides or stays
silent as docs/lint.md says."""

from __future__ import annotations

import ast
import textwrap

import pytest

from ampdoctor.lint import RULES, lint_source
from ampdoctor.lint.checks import CHECKS


def found(src: str, *, amp: bool = False) -> list[tuple[str, int, int]]:
    return [(f.code, f.line, f.col) for f in lint_source(textwrap.dedent(src), "t.py", amp=amp)]


def test_every_rule_has_a_check_docs_and_both_snippets() -> None:
    assert [r.code for r in RULES] == sorted(CHECKS) == [f"AMP{i:03d}" for i in range(1, len(RULES) + 1)]
    names = [r.name for r in RULES]
    assert len(set(names)) == len(names)
    for r in RULES:
        assert r.bad.strip() and r.good.strip() and r.why and r.fix and r.title, r.code
        ast.parse(r.bad)
        ast.parse(r.good)
        assert r.bad != r.good


@pytest.mark.parametrize("rule", RULES, ids=[r.code for r in RULES])
def test_bad_snippet_fires_at_its_place_and_good_does_not(rule) -> None:  # noqa: ANN001
    bad = [(f.line, f.col) for f in lint_source(rule.bad, "bad.py") if f.code == rule.code]
    assert bad == [rule.bad_at], f"{rule.code} bad snippet: {bad}"
    assert [f for f in lint_source(rule.good, "good.py") if f.code == rule.code] == []
    # and the bad snippet raises nothing else: one mistake per snippet
    assert {f.code for f in lint_source(rule.bad, "bad.py")} == {rule.code}
    assert lint_source(rule.good, "good.py") == []


# --- AMP001: the names followed ---------------------------------------------------------------------------------------

HEAD = """\
import torch
from torch import nn

model = nn.Linear(8, 1).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
"""


def test_clip_in_a_helper_between_backward_and_step() -> None:
    src = HEAD + """\

def clip(m):
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)


def train(loader):
    for x, y in loader:
        scaler.scale(model(x).sum()).backward()
        clip(model)
        scaler.step(optimizer)
        scaler.update()
"""
    assert found(src) == [("AMP001", 9, 5)]


def test_unscale_in_a_helper_before_the_clip_is_fine() -> None:
    src = HEAD + """\

def unscale_and_clip(sc, opt, m):
    sc.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)


for x, y in loader:
    scaler.scale(model(x).sum()).backward()
    unscale_and_clip(scaler, optimizer, model)
    scaler.step(optimizer)
    scaler.update()
"""
    assert found(src) == []


def test_scaler_passed_in_and_imported_clip() -> None:
    src = """\
    from torch.nn.utils import clip_grad_norm_


    def train_step(model, batch, optimizer, grad_scaler):
        loss = model(batch).mean()
        grad_scaler.scale(loss).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        grad_scaler.step(optimizer)
        grad_scaler.update()
    """
    assert found(src) == [("AMP001", 7, 5)]


def test_two_optimizers_the_unscaled_one_is_not_the_clipped_one() -> None:
    src = """\
    import torch

    gen, disc = Gen(), Disc()
    opt_g = torch.optim.Adam(gen.parameters())
    opt_d = torch.optim.Adam(disc.parameters())
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        scaler.scale(loss_fn(gen, disc, x)).backward()
        scaler.unscale_(opt_d)
        torch.nn.utils.clip_grad_norm_(disc.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(gen.parameters(), 1.0)
        scaler.step(opt_d)
        scaler.step(opt_g)
        scaler.update()
    """
    assert found(src) == [("AMP001", 11, 5)]


def test_clip_in_the_other_branch_of_an_amp_switch_is_fine() -> None:
    src = """\
    import torch


    def step(model, optimizer, scaler, loss, use_amp):
        if not use_amp:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    """
    assert found(src) == []


def test_clip_without_a_scaler_step_in_the_file_is_silent() -> None:
    src = """\
    import torch


    def clip_and_step(model, optimizer):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    """
    assert found(src) == []


# --- AMP002 -----------------------------------------------------------------------------------------------------------


def test_update_every_n_steps() -> None:
    src = HEAD + """\
for i, (x, y) in enumerate(loader):
    scaler.scale(model(x).sum()).backward()
    scaler.step(optimizer)
    if i % 10 == 0:
        scaler.update()
"""
    assert found(src) == [("AMP002", 11, 9)]


def test_update_once_after_the_loop() -> None:
    src = HEAD + """\
for x, y in loader:
    scaler.scale(model(x).sum()).backward()
    scaler.step(optimizer)
scaler.update()
"""
    assert found(src) == [("AMP002", 10, 1)]


def test_no_update_anywhere() -> None:
    src = HEAD + """\
for x, y in loader:
    scaler.scale(model(x).sum()).backward()
    scaler.step(optimizer)
"""
    assert found(src) == [("AMP002", 9, 5)]


def test_accumulation_and_amp_switch_are_fine() -> None:
    src = HEAD + """\
for i, (x, y) in enumerate(loader):
    scaler.scale(model(x).sum() / 4).backward()
    if (i + 1) % 4 != 0:
        continue
    scaler.step(optimizer)
    if use_amp:
        scaler.update()
    optimizer.zero_grad()
"""
    assert found(src) == []


def test_return_on_the_skip_path_inside_a_step_function() -> None:
    src = """\
    import torch


    def step(model, optimizer, scaler, loss):
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if norm > 100:
            optimizer.zero_grad()
            return None
        scaler.step(optimizer)
        scaler.update()
        return norm
    """
    assert found(src) == [("AMP002", 10, 9)]


def test_skip_path_that_updates_first_is_fine() -> None:
    src = HEAD + """\
for x, y in loader:
    scaler.scale(model(x).sum()).backward()
    scaler.unscale_(optimizer)
    if not all(torch.isfinite(p.grad).all() for p in model.parameters()):
        scaler.update()
        continue
    scaler.step(optimizer)
    scaler.update()
"""
    assert found(src) == []


# --- AMP003 / AMP004 --------------------------------------------------------------------------------------------------


def test_hook_defined_as_a_function() -> None:
    src = HEAD + """\

def guard(grad):
    grad = torch.nan_to_num(grad)
    return grad.clamp_(-5, 5)


for p in model.parameters():
    p.register_hook(guard)
"""
    assert found(src) == [("AMP004", 9, 12), ("AMP003", 10, 12)]


def test_hook_rules_need_a_scaler_or_amp() -> None:
    src = """\
    import torch
    from torch import nn

    model = nn.Linear(4, 4)
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-1, 1))
    """
    assert found(src) == []  # plain FP32 gradient clipping
    assert found(src, amp=True) == [("AMP003", 6, 31)]  # triage's amp stage adds a GradScaler


def test_nan_to_num_on_grad_before_and_after_unscale() -> None:
    src = HEAD + """\
for x, y in loader:
    scaler.scale(model(x).sum()).backward()
    for p in model.parameters():
        p.grad.nan_to_num_(0.0)
    scaler.step(optimizer)
    scaler.update()
"""
    assert found(src) == [("AMP004", 10, 9)]
    after = src.replace("    for p in model.parameters():\n", "    scaler.unscale_(optimizer)\n    for p in model.parameters():\n")
    assert found(after) == []  # found_inf was recorded by unscale_: the step is still skipped


# --- AMP005 -----------------------------------------------------------------------------------------------------------


def test_adam_on_half_through_a_params_list_and_after_float() -> None:
    src = """\
    import torch

    model = Net()
    model.half()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    """
    assert found(src) == [("AMP005", 6, 7)]
    assert found(src.replace("model.half()", "model.half()\n    model.float()")) == []
    assert found(src.replace("AdamW", "SGD")) == []  # no eps; updates still round, but not this rule


# --- masks and numerics -----------------------------------------------------------------------------------------------


def test_mask_constants_in_their_forms() -> None:
    src = """\
    import torch


    def f(scores, mask, bias):
        a = scores - 1e9 * (1 - mask)
        b = torch.where(mask, scores, -1e30)
        c = scores.masked_fill(~mask, float("-inf"))
        d = scores + bias * -1e4
        e = scores.masked_fill(~mask, -65504.0)
        return a, b, c, d, e


    x = model(inputs.half())
    """
    assert found(src) == [("AMP006", 5, 18), ("AMP006", 6, 35), ("AMP007", 8, 25)]


def test_mask_rules_stay_silent_in_fp32_and_bf16_files() -> None:
    src = textwrap.dedent("""\
    import torch


    def f(scores, mask):
        return scores.masked_fill(mask, -1e9)
    """)
    assert found(src) == []
    assert found(src + '\nctx = torch.autocast("cuda", dtype=torch.bfloat16)\n') == []
    assert found(src, amp=True) == [("AMP006", 5, 37)]


def test_finfo_min_added_through_a_name_and_filled_is_fine() -> None:
    src = """\
    import torch


    def f(scores, mask):
        big = torch.full_like(scores, torch.finfo(torch.float16).min)
        m = torch.triu(big, diagonal=1)
        filled = scores.masked_fill(mask, torch.finfo(torch.half).min)
        return scores + m, filled
    """
    assert found(src) == [("AMP008", 5, 35)]


def test_softmax_by_name_and_stable_form() -> None:
    src = """\
    import torch


    def f(x):
        e = torch.exp(x)
        p = e / e.sum(-1, keepdim=True)
        z = (x - x.max(-1, keepdim=True).values).exp()
        q = z / z.sum(-1, keepdim=True)
        return p, q


    y = f(model(x.half()))
    """
    assert found(src) == [("AMP009", 6, 9)]


def test_log_sigmoid_and_eps() -> None:
    src = """\
    import torch


    def f(x):
        a = torch.log(torch.sigmoid(x))
        b = torch.log(torch.softmax(x, -1) + 1e-10)
        c = torch.log(torch.softmax(x, -1) + 1e-6)
        return a, b, c


    with torch.cuda.amp.autocast():
        f(model(x))
    """
    assert found(src) == [("AMP010", 5, 9), ("AMP010", 6, 9)]


def test_eps_and_variance_follow_calls_into_a_model_forward() -> None:
    src = """\
    import torch
    from torch import nn


    class Norm(nn.Module):
        def forward(self, x):
            return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-12)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = Norm()

        def forward(self, x):
            return self.norm(x)


    model = Net().cuda()
    with torch.autocast(device_type="cuda"):
        out = model(x)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        out = model(x)
    """
    assert found(src) == [("AMP011", 7, 60), ("AMP012", 7, 60)]
    bf16 = src.replace('    with torch.autocast(device_type="cuda"):\n        out = model(x)\n', "")
    assert found(bf16) == []  # BF16 has FP32's range
    unknown = src.replace('device_type="cuda"', "device_type=device.type")
    assert found(unknown.replace(', dtype=torch.bfloat16', '')) == []  # device unknown: dtype unknown


# --- AMP013 / AMP014 / AMP015 -----------------------------------------------------------------------------------------


def test_checkpoint_through_a_helper_and_a_name() -> None:
    src = HEAD + """\

def save_checkpoint(state, path):
    torch.save(state, path)


def main():
    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(ckpt, "a.pt")
    save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "b.pt")
    ok = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    ok["scaler"] = scaler.state_dict()
    torch.save(ok, "c.pt")
"""
    assert found(src) == [("AMP013", 13, 12), ("AMP013", 15, 21)]


def test_checkpoint_without_a_scaler_in_reach_is_silent() -> None:
    src = """\
    import torch

    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "a.pt")
    """
    assert found(src) == []


def test_autocast_device_from_a_device_variable() -> None:
    src = """\
    import torch

    device = torch.device("cuda:0")
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.cpu.amp.autocast():
        out = model(x)
    """
    assert found(src) == [("AMP014", 6, 6)]
    assert found(src.replace('torch.device("cuda:0")', 'torch.device("cuda" if ok else "cpu")')) == []


def test_backward_without_scale_and_with_a_scaled_name() -> None:
    src = HEAD + """\
for x, y in loader:
    loss = model(x).sum()
    loss.backward()
    scaler.step(optimizer)
    scaler.update()
"""
    assert found(src) == [("AMP015", 9, 5)]
    scaled = src.replace("    loss.backward()\n", "    scaled = scaler.scale(loss)\n    scaled.backward()\n")
    assert found(scaled) == []


# --- noqa -------------------------------------------------------------------------------------------------------------


def test_noqa_silences_its_line_only_for_its_codes() -> None:
    rule = RULES[0]
    line = rule.bad.splitlines()[rule.bad_at[0] - 1]
    for comment, silent in (("  # noqa: AMP001", True), ("  # noqa", True), ("  # NOQA:AMP002,AMP001", True),
                            ("  # noqa: E501", False), ("  # noqa: AMP002", False)):
        src = rule.bad.replace(line, line + comment)
        assert (lint_source(src) == []) is silent, comment


def test_masks_chosen_by_dtype_or_made_as_new_tensors_are_fine() -> None:
    src = """\
    import numpy as np
    import torch


    def f(x, p_mask, mask, start):
        if p_mask.dtype == torch.float16:
            x = x * (1 - p_mask) - 65500 * p_mask
        else:
            x = x * (1 - p_mask) - 1e30 * p_mask
        bias = torch.where(mask > 0, 0.0, -1e10)
        start = np.where(mask, -10000.0, start)
        big = -1e9 if x.dtype == torch.float32 else -1e4
        return x, bias, start, x.masked_fill(mask, big)


    y = f(model(x.half()), p, m, s)
    """
    assert found(src) == []


def test_log_of_a_sigmoid_through_a_name_and_of_one_minus_it() -> None:
    src = """\
    import torch


    def hand_bce(logits, target):
        p = torch.sigmoid(logits)
        return -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()


    with torch.autocast("cuda"):
        loss = hand_bce(model(x), y)
    """
    assert found(src) == [("AMP010", 6, 23), ("AMP010", 6, 53)]
