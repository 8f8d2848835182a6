"""Run the rules over files: parse, check, drop what ``# noqa`` silences, keep what is selected.

Pure reading: no user code is imported or run. Bad input (a path that does not exist, a file that
does not parse, an unknown rule code, a bad ``[tool.ampdoctor.lint]`` table) raises ``LintInputError``.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import stat
import time
import tokenize
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ampdoctor.errors import UsageError
from ampdoctor.lint.check_context import Ctx
from ampdoctor.lint.checks import CHECKS
from ampdoctor.lint.flow import FileFacts
from ampdoctor.lint.rules import BY_CODE, RULES

SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".nox", "node_modules", "build", "dist",
             ".mypy_cache", ".ruff_cache", ".pytest_cache", "site-packages", ".eggs"}


MAX_FILE_BYTES = 32 << 20
"""A file larger than this is skipped with a note (the size budget): a generated module of 5 MB lints in seconds
(docs/lint.md), one of 32 MB is data, not a training script."""
MAX_FILE_SECONDS = 60.0
"""A file whose rules take longer than this (CPU seconds, checked between rules) is skipped with a note (the time
budget): none is reported half-checked."""


class LintInputError(UsageError):
    """A path, a file or an option the lint cannot use; the message says what to do."""


class LintSkip(Exception):
    """A file left unchecked on purpose (too large, nested too deep, over the time budget): one line saying why."""


@dataclass(frozen=True)
class LintFinding:
    """One finding: where (line and column from 1), which rule, and the one-line message."""

    path: str
    line: int
    col: int
    code: str
    message: str

    @property
    def fix(self) -> str:
        return BY_CODE[self.code].fix

    @property
    def title(self) -> str:
        return BY_CODE[self.code].title

    def location(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


@dataclass
class Selection:
    """Which codes run: ``select`` (codes or prefixes, default all) minus ``ignore``."""

    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def codes(self) -> list[str]:
        chosen = [r.code for r in RULES if not self.select or any(r.code.startswith(s) for s in self.select)]
        return [c for c in chosen if not any(c.startswith(s) for s in self.ignore)]


def parse_codes(text: str | Iterable[str] | None, where: str) -> tuple[str, ...]:
    """'AMP001,AMP003' or a list -> ('AMP001', 'AMP003'); a code (or prefix) that matches no rule is bad input."""
    if text is None:
        return ()
    items = [t for part in ([text] if isinstance(text, str) else list(text)) for t in re.split(r"[,\s]+", str(part)) if t]
    out = []
    for t in items:
        t = t.strip().upper()
        if t == "ALL":
            t = "AMP"
        if not any(r.code.startswith(t) for r in RULES):
            raise LintInputError(f"{where}: no rule {t!r}; the rules are {RULES[0].code}..{RULES[-1].code} "
                                 "(ampdoctor lint --list-rules)")
        out.append(t)
    return tuple(out)


_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Za-z]+[0-9]+(?:\s*,?\s*[A-Za-z]+[0-9]+)*))?", re.I)


def noqa_lines(source: str) -> dict[int, set[str] | None]:
    """Line -> the codes its ``# noqa: AMP001`` comment silences (None: a bare ``# noqa``, every code)."""
    out: dict[int, set[str] | None] = {}
    if _NOQA.search(source) is None:  # most files: no tokenizing (pure Python, the slowest part of a large file)
        return out
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):  # pragma: no cover - the file parsed, so it tokenizes
        return out
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        m = _NOQA.search(tok.string)
        if m is None:
            continue
        codes = m.group("codes")
        line = tok.start[0]
        if codes is None:
            out[line] = None
        elif out.get(line, set()) is not None:
            out.setdefault(line, set()).update(c.upper() for c in re.split(r"[,\s]+", codes) if c)  # type: ignore[union-attr]
    return out


def lint_source(source: str, path: str = "<string>", *, codes: Sequence[str] | None = None,
                amp: bool = False) -> list[LintFinding]:
    """The findings in one file's text, sorted by line and column.

    ``amp``: the file is known to run under autocast + GradScaler even if it never names one (triage's
    spec: its amp stage adds the scaler), so the hook rules apply.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        where = f"{path}:{e.lineno or 1}:{(e.offset or 1)}"
        raise LintInputError(f"{where}: cannot parse ({e.msg}); fix the file or leave it out "
                             "(--exclude, or exclude in [tool.ampdoctor.lint])") from None
    except (RecursionError, MemoryError) as e:  # a 10,000-term sum, a long chain of unary minus: generated code
        raise LintSkip(f"{path}: skipped, an expression nested deeper than Python's parser takes "
                       f"({type(e).__name__}); nothing in it was checked") from None
    try:
        return _check(tree, source, path, codes, amp)
    except (RecursionError, MemoryError) as e:
        raise LintSkip(f"{path}: skipped, an expression nested too deep to check ({type(e).__name__}); nothing in it "
                       "was checked") from None


def _check(tree: ast.Module, source: str, path: str, codes: Sequence[str] | None, amp: bool) -> list[LintFinding]:
    start = time.process_time()
    ctx = Ctx(FileFacts(tree, source, amp=amp))
    silenced = noqa_lines(source)
    found: dict[tuple[int, int, str], LintFinding] = {}
    for code in codes if codes is not None else [r.code for r in RULES]:
        if time.process_time() - start > MAX_FILE_SECONDS:
            raise LintSkip(f"{path}: skipped, checking it took more than {MAX_FILE_SECONDS:.0f} s (the time budget of a "
                           "file); nothing in it was reported (exclude it, or split it)")
        for node, message in CHECKS[code](ctx):
            line, col = getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1
            quiet = silenced.get(line, set())
            if quiet is None or code in quiet:  # type: ignore[operator]
                continue
            found.setdefault((line, col, code), LintFinding(path, line, col, code, message))
    return [found[k] for k in sorted(found)]


def read_source(path: Path) -> str:
    """The text of a regular file within the size budget (a named pipe, a device, a socket is never opened:
    reading one could wait for ever)."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise LintInputError(f"{path}: not a regular file (a named pipe, a device or a socket); give .py files or "
                                 "folders")
        if st.st_size > MAX_FILE_BYTES:
            raise LintSkip(f"{path}: skipped, {_size(st.st_size)} is over the size budget of a file "
                           f"({_size(MAX_FILE_BYTES)}); nothing in it was checked")
        data = path.read_bytes()
    except OSError as e:
        raise LintInputError(f"{path}: cannot read ({e.strerror or e}); check the path and its permissions") from None
    try:
        return tokenize_source(data)
    except (SyntaxError, UnicodeDecodeError) as e:
        raise LintInputError(f"{path}: not a text Python file ({type(e).__name__}); give .py files or folders") from None


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 10**6 else f"{n} bytes"


def tokenize_source(data: bytes) -> str:
    """The text of a Python file, decoded as Python does (a coding cookie, else UTF-8)."""
    enc, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(enc)


def python_files(paths: Sequence[Path], exclude: Sequence[str] = ()) -> list[Path]:
    """The .py files of the given files and folders (folders walked, hidden and build folders skipped),
    in a stable order; a path given that does not exist is bad input."""
    out: list[Path] = []
    for p in paths:
        if not p.exists():
            raise LintInputError(f"{p}: no such file or folder; give Python files or folders to check")
        if not p.is_dir():  # a file (a named pipe given by name: read_source says it is none)
            if not _excluded(p, exclude):
                out.append(p)
            continue
        for f in sorted(p.rglob("*.py")):
            rel = f.relative_to(p)
            if any(part in SKIP_DIRS or (part.startswith(".") and part not in (".", "..")) for part in rel.parts[:-1]):
                continue
            if not _regular(f):  # a named pipe or a socket called x.py: never opened (it would wait for a writer)
                continue
            if not _excluded(f, exclude):
                out.append(f)
    return list(dict.fromkeys(out))


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return True  # unreadable: read_source says so, one line


def _excluded(path: Path, patterns: Sequence[str]) -> bool:
    text = path.as_posix()
    return any(fnmatch.fnmatch(text, pat) or fnmatch.fnmatch(path.name, pat) or fnmatch.fnmatch(text, f"*/{pat}")
               or fnmatch.fnmatch(text, f"*/{pat}/*") for pat in patterns)


@dataclass
class Result:
    findings: list[LintFinding] = field(default_factory=list)
    files: int = 0
    errors: list[str] = field(default_factory=list)
    """Files that could not be read or parsed (one line each); the others were still checked."""
    skipped: list[str] = field(default_factory=list)
    """Files left unchecked on purpose (``LintSkip``: the size or time budget, nesting too deep), one line each."""


def lint_paths(paths: Sequence[Path], selection: Selection | None = None, *, amp: bool = False) -> Result:
    """Lint files and folders with one selection; raises LintInputError on bad input."""
    sel = selection or Selection()
    files = python_files(paths, sel.exclude)
    codes = sel.codes()
    res = Result()
    for f in files:
        try:
            res.findings += lint_source(read_source(f), str(f), codes=codes, amp=amp)
        except LintInputError as e:
            res.errors.append(str(e))
            continue
        except LintSkip as e:
            res.skipped.append(str(e))
            continue
        res.files += 1  # checked: read, parsed and every rule run
    return res
