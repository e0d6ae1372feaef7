"""Reading the engines' placements for the goodput crossover (pdserve_bench/goodput.py) where nothing listens:
a real connection, refused (the simulation itself: bench/tests/test_attainment.py)."""

from __future__ import annotations


def test_plain_engines_have_no_placements_to_read():
    from pdserve_bench.goodput import placements_now

    assert placements_now(["http://127.0.0.1:1", "http://127.0.0.1:2"]) is None
    assert placements_now("http://127.0.0.1:1") is None  # nothing listens: no figure, no failure
