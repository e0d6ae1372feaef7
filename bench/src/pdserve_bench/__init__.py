"""``pdserve bench``: load generation, latency statistics, goodput, plots, and self-contained scenarios.

Its own distribution (``pdserve-bench``, ``bench/`` in pdserve's repository), released with pdserve's number;
``pdserve bench`` imports :func:`pdserve_bench.cli.run_bench` when it is installed."""

from pdserve_bench._version import __version__

__all__ = ["__version__"]
