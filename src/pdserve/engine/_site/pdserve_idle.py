"""How long an idle CPU engine worker sleeps between two looks at its step queue (see sitecustomize.py, 3.).

Loaded from the engine's PYTHONPATH by sitecustomize.py; no imports, no side effects.
"""

#: The sleep right after the reader stops spinning; it doubles with each IDLE_BACKOFF_S of idleness, up to
#: IDLE_POLL_MAX_MS. A step's notification wakes the reader at once; only a lost one waits out a sleep.
IDLE_POLL_MS = 5
IDLE_POLL_MAX_MS = 50
IDLE_BACKOFF_S = 1.0


def idle_poll_ms(idle_s: float) -> int:
    """How long an idle reader sleeps in one ``poll()``, after ``idle_s`` seconds of sleeping."""
    doublings = min(int(max(idle_s, 0.0) / IDLE_BACKOFF_S), 8)
    return min(IDLE_POLL_MS << doublings, IDLE_POLL_MAX_MS)
