"""Issue 44 item 5: the lint's mask, hook and softmax rules decide from what an expression can be, not from a name:
the extended attention mask handed on as a product, a hook that is ``torch.nan_to_num`` itself, and an exponent
that cannot be positive (a Gaussian profile) is no hand-written softmax."""

from __future__ import annotations

import ast
import math
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.lint import lint_source
from ampdoctor.lint.bounds import Bounds
from ampdoctor.lint.flow import FileFacts


def found(src: str, *, amp: bool = False) -> list[tuple[str, int, int]]:
    return [(f.code, f.line, f.col) for f in lint_source(textwrap.dedent(src), "t.py", amp=amp)]


def test_the_extended_attention_mask_handed_on_as_a_product() -> None:
    src = """\
    import torch


    def extend(mask):
        return (1.0 - mask) * -1e9


    def extend2(mask):
        return -1e9 * (1.0 - mask[:, None, None, :])


    def attend(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask * -1e9)


    def weak(mask):
        return (1.0 - mask) * -10000.0


    def fine(mask, dtype):
        return (1.0 - mask) * torch.finfo(dtype).min
    """
    assert found(src, amp=True) == [("AMP006", 5, 27), ("AMP006", 9, 12), ("AMP006", 13, 87), ("AMP007", 17, 27)]
    assert found(src) == []  # (a file that may not run FP16: no mask rule, as before)


def test_a_product_that_is_no_mask_is_left_alone() -> None:
    src = """\
    def f(x, w):
        return x * 1e9, x * -1.0, 2 * -1e9, foo(x * 3.0)
    """
    assert found(src, amp=True) == []


def test_nan_to_num_registered_as_the_hook_itself() -> None:
    src = """\
    import functools
    import torch

    scaler = torch.amp.GradScaler()
    for p in model.parameters():
        p.register_hook(torch.nan_to_num)
    for p in model.parameters():
        p.register_hook(functools.partial(torch.clamp, min=-1.0, max=1.0))
    """
    assert found(src) == [("AMP004", 6, 21), ("AMP003", 8, 21)]
    # no GradScaler: the hook hides nothing from it
    assert found(src.replace("scaler = torch.amp.GradScaler()", "")) == []
    # a function of the user's own is read as before (a def that does not hide anything)
    own = "import torch\nscaler = torch.amp.GradScaler()\ndef keep(g):\n    return g\nfor p in m.parameters():\n    p.register_hook(keep)\n"
    assert found(own) == []


@pytest.mark.parametrize("expr", [
    "-((i - c) ** 2) / (2 * w ** 2)",  # a Gaussian profile
    "-(d * d) / (s * s)",
    "-d.pow(2).sum(-1) / (2.0 * sigma ** 2)",
    "-torch.abs(x) * 0.5",
    "x.clamp(max=10.0)",
    "torch.tanh(x) * 5.0",
    "-F.softplus(x)",
    "-r2 / (2 * w ** 2)",  # through a name assigned once: r2 = (i - c) ** 2
])
def test_an_exponent_that_cannot_overflow_is_no_hand_written_softmax(expr: str) -> None:
    src = f"""\
    import torch
    import torch.nn.functional as F


    def profile(x, i, c, w, d, s, sigma, tau):
        r2 = (i - c) ** 2
        g = torch.exp({expr})
        return g / g.sum(-1, keepdim=True)


    y = profile(model(x.half()), 0, 0, 1, 1, 1, 1, 1)
    """
    assert found(src) == []


@pytest.mark.parametrize("expr", [
    "x", "-x", "-(d * d) / s", "-torch.abs(x) / tau",  # (a divisor of either sign)
    "(i - c) ** 2 / (2 * w ** 2)", "-((i - c) ** 3)", "x.clamp(max=12.0)", "torch.tanh(x) * 12.0",
    "-(d * e)", "x / (2 * w ** 2)", "r2 / w",
])
def test_an_exponent_that_can_exceed_11_is_still_found(expr: str) -> None:
    src = f"""\
    import torch


    def f(x, i, c, w, d, e, s, tau):
        r2 = (i - c) ** 2
        g = torch.exp({expr})
        return g / g.sum(-1, keepdim=True)


    y = f(model(x.half()), 0, 0, 1, 1, 1, 1, 1)
    """
    assert found(src) == [("AMP009", 7, 12)]


# -- the interval is a true bound: property test against evaluation ---------------------------------------------
_EXPRS = ["-((a - b) ** 2) / (2 * c ** 2)", "-(a * a) / (b * b)", "(a - b) * (a + b)", "-abs(a) * b ** 2",
          "(a ** 2 + b ** 2) / (1.0 + c ** 2)", "-(a ** 2) - b ** 2 + 3.0", "a * -2.0 + b", "tanh(a) * 4.0 - b ** 2"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_EXPRS), st.floats(-1e3, 1e3), st.floats(-1e3, 1e3), st.floats(-1e3, 1e3))
def test_the_bounds_hold_for_every_value(expr: str, a: float, b: float, c: float) -> None:
    tree = ast.parse(f"def f(a, b, c):\n    return {expr}\n")
    facts = FileFacts(tree, "")
    ret = tree.body[0].body[0]  # type: ignore[attr-defined]
    lo, hi = Bounds(facts, facts.scope_of(ret))(ret.value)
    try:
        v = eval(expr, {"abs": abs, "tanh": math.tanh}, {"a": a, "b": b, "c": c})  # noqa: S307
    except ZeroDivisionError:
        return
    if math.isfinite(v):
        assert lo - 1e-9 * abs(v) <= v <= hi + 1e-9 * abs(v), (expr, a, b, c, lo, hi, v)
