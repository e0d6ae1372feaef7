"""A stopping engine replica lets the requests it holds finish before its engine stops.

Ray Serve stops a replica when it scales a role down, redeploys the app or drains a node. The router reaches
engines over HTTP, not through Serve's handles, so Serve sees no requests on an engine replica and would stop
it at once, cutting every stream on it. Instead the replica leaves the app's registry first (the router stops
picking it at its next refresh), then waits until its engine runs and queues nothing (vLLM's
``num_requests_running`` + ``num_requests_waiting``), within the deployment's ``graceful_shutdown_timeout_s``;
only then does the engine stop. A stream still running at that bound moves to another replica
(router/migrate.py) where it can.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Seconds kept from ``graceful_shutdown_timeout_s`` for stopping the engine itself (Serve kills the replica
#: at that bound).
STOP_MARGIN_S = 3.0
#: How often the engine's request gauges are read while it drains.
POLL_S = 0.25


def wait_until_idle(busy: Callable[[], float | None], *, min_s: float, max_s: float,
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
                    ) -> tuple[bool, float]:
    """Wait at least ``min_s`` (the router's refresh, so that nothing new arrives after the last look) and
    until ``busy()`` (requests running or queued on the engine; None: it cannot be read, e.g. the engine is
    gone) is 0 or None, at most ``max_s``. Returns (drained, seconds waited)."""
    t0 = clock()
    while True:
        waited = clock() - t0
        if waited >= max_s:
            return False, waited
        if waited >= min_s:
            n = busy()
            if n is None or n <= 0:
                return True, waited
        sleep(POLL_S)
