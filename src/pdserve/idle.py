"""How idle servers wait: an idle CPU engine worker between two looks at its step queue (see
engine/_site/sitecustomize.py, 3.), and a uvicorn server between two ticks (:func:`uvicorn_main_loop`: the
engines' HTTP servers, sitecustomize.py 7., and the router's direct ingress, router/ingress.py).

The engine's sitecustomize.py loads this file by its path; no imports at load, no side effects.
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


#: Seconds between two ticks of a uvicorn server (uvicorn's own: 0.1). A tick refreshes the Date header
#: (once a second either way) and looks whether the server should stop, so a stop takes at most this long
#: to begin; ten wake-ups a second of an idle server become one.
UVICORN_TICK_S = 1.0


async def uvicorn_main_loop(self: object) -> None:
    """``uvicorn.Server.main_loop`` ticking every :data:`UVICORN_TICK_S`: the tick counter moves as it would
    in that time, so ``on_tick``'s once-a-second work runs on every tick."""
    import asyncio

    per_tick = max(1, round(UVICORN_TICK_S / 0.1))
    counter = 0
    should_exit = await self.on_tick(counter)  # type: ignore[attr-defined]
    while not should_exit:
        counter = (counter + per_tick) % 864000
        await asyncio.sleep(UVICORN_TICK_S)
        should_exit = await self.on_tick(counter)  # type: ignore[attr-defined]
