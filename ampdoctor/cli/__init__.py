"""The command line: one module per command, one error boundary."""

from ampdoctor.cli.main import main

__all__ = ["main"]
