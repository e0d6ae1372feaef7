"""Run a command and take it down with its parent.

``python -m pdserve.engine.guard PARENT_PID -- CMD ...`` starts CMD in this process group, forwards
SIGTERM/SIGINT to it, and kills the whole group when PARENT_PID goes away. An engine replica that is
killed outright (SIGKILL, node failure of the actor) thus never leaves a vLLM server behind. CMD is also
told to stop (SIGTERM, Linux's parent-death signal) when the guard itself is killed outright: a container
whose processes were killed one by one left its vLLM servers running otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdserve.settings import ENGINE_CORES_ENV, ENGINE_NICE_ENV


def _kill_group(sig: int) -> None:
    try:
        os.killpg(os.getpgid(0), sig)
    except ProcessLookupError:
        pass


def _die_with_parent() -> None:
    """In the child, before it runs CMD: SIGTERM when its parent (this guard) dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


#: prctl(2)'s option for the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m pdserve.engine.guard PARENT_PID -- CMD ...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    cores = os.environ.get(ENGINE_CORES_ENV)
    if cores and hasattr(os, "sched_setaffinity"):
        # The whole engine (API server, engine core, workers) stays on the cores claimed for it.
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    nice = os.environ.get(ENGINE_NICE_ENV)
    if nice:
        # Inherited by the whole engine: it yields the CPU to the router and Ray when they have work.
        os.nice(int(nice))
    child = subprocess.Popen(argv[2:], preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while True:
        rc = child.poll()
        if rc is not None:
            # The server is gone: take whatever it left in the group (engine core processes) too.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _kill_group(signal.SIGTERM)
            return rc
        if not stopping and os.getppid() != parent:
            stopping = True
            child.terminate()
            deadline = time.monotonic() + 10
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _kill_group(signal.SIGKILL)
            return 1
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
