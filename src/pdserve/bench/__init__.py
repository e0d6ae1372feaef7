"""``pdserve bench``: load generation, latency statistics, goodput, plots, and self-contained scenarios."""
