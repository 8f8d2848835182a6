"""How the commands' help and usage errors read: short help per option in panels, ``--steps N`` placeholders, no
``<bool>`` beside a flag, and a hint for the options people reach for under another name (``--dtype`` for
``--target``). Every ``--help`` fits 80 columns (tests/test_cli_help.py)."""

from __future__ import annotations

from typing import Any

import typer.core

RUN, SCALER, CODE, REPLAY, OUTPUT, TABLE = "Run", "GradScaler", "Your code", "Replay a real run", "Output", "Table"
"""The panels (``rich_help_panel``) the commands' options are grouped in."""


def default(value: object) -> str:
    """' [default: 50]' for an option whose default lives elsewhere (TRIAGE_OPTIONS may set it), escaped so that
    rich does not read it as markup."""
    return f" \\[default: {value}]"


# Options of other tools (and of ampdoctor's other commands) that people type for one of triage's: the hint names
# the option that does it. ``difflib``'s near-miss spelling (``--step``: ``--steps``) comes from click itself.
ALIASES: dict[str, str | tuple[str, ...]] = {
    "--dtype": "--target (amp, fp16 or bf16)",
    "--precision": ("--target (amp, fp16 or bf16)", "--dtype LIST (fp16, bf16, fp8_e4m3, fp8_e5m2)"),
    "--target": "--dtype LIST (fp16, bf16, fp8_e4m3, fp8_e5m2)", "--format": "--dtype LIST",
    "--amp": "--target amp", "--fp16": "--target fp16", "--bf16": "--target bf16", "--half": "--target fp16",
    "--max-steps": "--steps N", "--num-steps": "--steps N", "--iters": "--steps N", "--iterations": "--steps N",
    "--clip": "--max-norm X", "--grad-clip": "--max-norm X", "--max-grad-norm": "--max-norm X",
    "--clip-grad-norm": "--max-norm X",
    "--grad-accum": "--accumulate N", "--gradient-accumulation-steps": "--accumulate N", "--accum": "--accumulate N",
    "--output": "--report PATH (.md, .html or .json)", "--out": "--report PATH", "--html": "--report PATH.html",
    "--gpu": "--device cuda", "--cuda": "--device cuda", "--cpu": "--device cpu",
    "--capture": "--from DIR", "--resume": "--checkpoint PATH", "--ckpt": "--checkpoint PATH",
    "--keys": "--batch-keys IN:TARGET", "--labels": "--batch-keys IN:TARGET", "--target-key": "--batch-keys IN:TARGET",
}


class HintedCommand(typer.core.TyperCommand):
    """A command whose "No such option" names the option meant (``ALIASES``) when it is one of ours; else click's
    near-miss spellings (``--step``: ``--steps``) stand."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)  # type: ignore[no-any-return]
        except Exception as e:
            name = getattr(e, "option_name", None)
            if type(e).__name__ == "NoSuchOption" and name:
                hint = _hint(self, name)
                if hint:  # ours knows the meaning; click's spelling matches (--target: --parquet, --report) do not
                    e.message = f"No such option: {name}; did you mean {hint}?"  # type: ignore[attr-defined]
                    e.possibilities = None  # type: ignore[attr-defined]
            raise


def _hint(cmd: Any, name: str) -> str | None:
    hints = ALIASES.get(name.split("=", 1)[0], ())
    ours = {o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}
    return next((h for h in ((hints,) if isinstance(hints, str) else hints) if h.split()[0] in ours), None)


def _no_python_types() -> None:
    """Flags take no value: no ``<bool>`` beside them; an argument named by its metavar (``SPEC``, ``CSV...``) needs
    no ``<path>`` beside it either (typer 0.20+ prints the annotation's type)."""
    for cls, bare in ((typer.core.TyperOption, lambda p: getattr(p, "is_flag", False)),
                      (typer.core.TyperArgument, lambda p: getattr(p, "metavar", None) is not None)):
        original = getattr(cls, "display_type_rich", None)
        if original is None or getattr(original, "_ampdoctor", False):
            continue

        def display_type_rich(self: Any, ctx: Any, _orig: Any = original, _bare: Any = bare) -> Any:
            return None if _bare(self) else _orig(self, ctx)

        display_type_rich._ampdoctor = True  # type: ignore[attr-defined]
        cls.display_type_rich = display_type_rich  # type: ignore[attr-defined,method-assign]


_no_python_types()

__all__ = ["ALIASES", "CODE", "OUTPUT", "REPLAY", "RUN", "SCALER", "TABLE", "HintedCommand", "default"]
