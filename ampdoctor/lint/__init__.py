"""``ampdoctor lint``: AMP mistakes found in a training script's text, before it runs.

Pure functions over the standard ``ast`` module: nothing here imports torch or the user's code.
``rules.RULES`` is the data (id, why, fix, bad and good snippets); ``checks.CHECKS`` the functions
that find them; ``checker`` runs them over files with ``# noqa`` and a selection.
"""

from ampdoctor.lint.checker import LintFinding, LintInputError, Selection, lint_paths, lint_source
from ampdoctor.lint.rules import BY_CODE, RULES, Rule

__all__ = ["BY_CODE", "RULES", "LintFinding", "LintInputError", "Rule", "Selection", "lint_paths", "lint_source"]
