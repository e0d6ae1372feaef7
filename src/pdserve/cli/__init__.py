"""The ``pdserve`` command line."""

from pdserve.cli.main import main

__all__ = ["main"]
