"""``[tool.ampdoctor.lint]`` in the nearest pyproject.toml: select, ignore, exclude.

```toml
[tool.ampdoctor.lint]
select = ["AMP"]            # codes or prefixes (default: every rule)
ignore = ["AMP007"]
exclude = ["legacy/*.py"]   # glob patterns, matched against the path and the file name
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampdoctor.lint.checker import LintInputError, Selection, parse_codes

KEYS = ("select", "ignore", "exclude")


def nearest_pyproject(start: Path) -> Path | None:
    """The pyproject.toml in ``start`` (a file's folder) or the closest folder above it."""
    here = start.resolve()
    if not here.is_dir():
        here = here.parent
    for d in (here, *here.parents):
        p = d / "pyproject.toml"
        if p.is_file():
            return p
    return None


def read_table(pyproject: Path) -> dict[str, Any]:
    """The ``[tool.ampdoctor.lint]`` table ({} when absent); a file that is not TOML is bad input."""
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            return {}
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise LintInputError(f"{pyproject}: cannot read ({e}); fix it or run from another folder") from None
    except tomllib.TOMLDecodeError as e:
        raise LintInputError(f"{pyproject}: not valid TOML ({e}); fix it to use [tool.ampdoctor.lint]") from None
    table: Any = data
    for i, key in enumerate(("tool", "ampdoctor", "lint")):
        table = table.get(key, {})
        if not isinstance(table, dict):  # `[tool] ampdoctor = "strict"`: a value where a table belongs
            name = ".".join(("tool", "ampdoctor", "lint")[: i + 1])
            raise LintInputError(f"{pyproject}: {name} is {type(table).__name__} {str(table)[:30]!r}, not a table; "
                                 f"write [tool.ampdoctor.lint] with {', '.join(KEYS)} (docs/lint.md)")
    bad = sorted(k for k in table if k.replace("-", "_") not in KEYS)
    if bad:
        raise LintInputError(f"{pyproject}: [tool.ampdoctor.lint] has no key {bad[0]!r}; the keys are {', '.join(KEYS)}")
    for k, v in table.items():
        if not (isinstance(v, list) and all(isinstance(x, str) for x in v)) and not isinstance(v, str):
            example = '["legacy/*.py", "gen_*.py"] (globs of files)' if k == "exclude" else '["AMP007"]'
            raise LintInputError(f"{pyproject}: [tool.ampdoctor.lint] {k} is {v!r:.30}, not a list of strings; "
                                 f"e.g. {k} = {example}")
    return table


def selection(pyproject: Path | None, select: str | None = None, ignore: str | None = None,
              exclude: list[str] | None = None) -> Selection:
    """The selection for a run: the command line's --select replaces the table's select, --ignore and
    --exclude add to its ignore and exclude."""
    table = read_table(pyproject) if pyproject is not None else {}
    where = f"{pyproject} [tool.ampdoctor.lint]" if pyproject is not None else "config"
    sel = parse_codes(select, "--select") if select else parse_codes(table.get("select"), f"{where} select")
    ign = parse_codes(table.get("ignore"), f"{where} ignore") + parse_codes(ignore, "--ignore")
    exc_t = table.get("exclude") or []
    exc = ([exc_t] if isinstance(exc_t, str) else list(exc_t)) + list(exclude or [])
    return Selection(sel, ign, tuple(exc))
