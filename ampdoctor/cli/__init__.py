"""The command line: one module per command, one error boundary."""

from ampdoctor.cli.app import main

__all__ = ["main"]
