"""The router process's Python heap: keep the cyclic garbage collector's pauses out of request latency.

Everything the router imports and builds at start stays alive for its whole life; a full collection scans
all of it, during which the event loop answers nothing (no refusal, no streamed token): 300-360 ms on one
core when the router imported vLLM's request models (half a million container objects; the checks now run
on an engine). :func:`settle` runs once at app start: it collects, then freezes every object alive at that
point (:func:`gc.freeze`), so later collections scan only what requests allocate. :func:`watch_pauses` times
every collection into a histogram (``pdserve_router_gc_pause_seconds{generation}``), so a pause that still
reaches latency shows on /metrics.
"""

from __future__ import annotations

import gc
import time
from typing import Any

_started: list[float] = []
_watched: list[Any] = []


def settle() -> int:
    """Collect once, then move every live object to the permanent generation. Returns how many objects
    later collections no longer scan."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def watch_pauses(histogram: Any) -> None:
    """Observe each collection's duration into ``histogram`` (labelled by generation). Once per process: a
    second call replaces the histogram rather than adding a callback."""
    if _watched:
        _watched[0] = histogram
        return
    _watched.append(histogram)

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _started[:] = [time.perf_counter()]
        elif _started:
            _watched[0].labels(str(info.get("generation", -1))).observe(time.perf_counter() - _started[0])
            _started.clear()

    gc.callbacks.append(callback)
