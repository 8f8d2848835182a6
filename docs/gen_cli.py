"""Generate docs/cli.md from the commands' --help, so the reference cannot go stale.

    python docs/gen_cli.py            # rewrite docs/cli.md
    python docs/gen_cli.py --stdout   # print it (the test compares)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from typer.testing import CliRunner

os.environ["COLUMNS"] = "80"
os.environ["NO_COLOR"] = "1"
os.environ["TERM"] = "dumb"

from ampdoctor.cli.app import app  # noqa: E402


def generate() -> str:
    runner = CliRunner()
    parts = ["# Command-line reference", "", "Generated from `--help` by `python docs/gen_cli.py`; do not edit by hand.", ""]
    for args in ([], ["triage"], ["layers"], ["scaler"], ["lint"], ["build-kernel"], ["doctor"]):
        res = runner.invoke(app, [*args, "--help"], prog_name="ampdoctor", env={"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"})
        title = "ampdoctor " + " ".join(args) if args else "ampdoctor"
        text = "\n".join(line.rstrip() for line in res.output.strip("\n").splitlines())
        parts += [f"## `{title}`", "", "```text", text, "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    text = generate()
    if "--stdout" in sys.argv:
        sys.stdout.write(text)
    else:
        (Path(__file__).parent / "cli.md").write_text(text)
