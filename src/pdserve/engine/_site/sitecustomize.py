"""Loaded by every Python process of a pdserve CPU engine (the engine's PYTHONPATH starts here).

vLLM's NIXL connector on CPU moves the worker's main thread to "the last core of each NUMA node" with
``os.sched_setaffinity`` (to keep KV loads off the compute cores), ignoring the cores the process may
use. With two engines on one host, both workers land on the same core, and the worker's idle busy-loop
(``sched_yield`` for 1 s after each step) then steals that core from the other engine's compute: the
measured P/D slowdowns and stalls on small hosts. pdserve gives every engine its own cores and clamps
every affinity request of the engine's processes into them.
"""

from __future__ import annotations

import os


def _install() -> None:
    cores = os.environ.get("PDSERVE_ENGINE_CORES")
    if not cores or not hasattr(os, "sched_setaffinity"):
        return
    allowed = frozenset(int(c) for c in cores.split(",") if c.strip().isdigit())
    if not allowed:
        return
    original = os.sched_setaffinity

    def clamped(pid: int, mask: object) -> None:
        want = {int(c) for c in mask}  # type: ignore[attr-defined]
        inside = want & allowed
        original(pid, inside or allowed)

    os.sched_setaffinity = clamped  # type: ignore[assignment]


_install()
