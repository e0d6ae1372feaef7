"""What an engine's server process is held to, whoever starts it (its guard, engine/guard.py, or the engine
forkserver, engine/forkserver.py): its cores, its niceness, and stopping when the process that started it
dies."""

from __future__ import annotations

import os
import signal

from pdserve.settings import ENGINE_CORES_ENV, ENGINE_NICE_ENV

#: prctl(2)'s option for the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def apply_engine_limits() -> None:
    """The engine's cores and niceness (from its environment) for this process and all it starts."""
    cores = os.environ.get(ENGINE_CORES_ENV)
    if cores and hasattr(os, "sched_setaffinity"):
        # The whole engine (API server, engine core, workers) stays on the cores claimed for it.
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    nice = os.environ.get(ENGINE_NICE_ENV)
    if nice:
        # Inherited by the whole engine: it yields the CPU to the router and Ray when they have work.
        os.nice(int(nice))


def die_with_parent(parent: int | None = None) -> None:
    """SIGTERM to this process when its parent dies (Linux only; elsewhere nothing). ``parent``: the pid of the
    process that started this one, when known: if it died before the request was made (between its fork and
    this call), the kernel sends nothing, so the signal comes now."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (not a handler inherited from the parent: it ends here)
        os.kill(os.getpid(), signal.SIGTERM)
