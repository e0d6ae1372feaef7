"""Run a command and take it down with its parent.

``python -m pdserve.engine.guard PARENT_PID -- CMD ...`` starts CMD in this process group, forwards
SIGTERM/SIGINT to it, and kills the whole group when PARENT_PID goes away. An engine replica that is
killed outright (SIGKILL, node failure of the actor) thus never leaves a vLLM server behind. CMD is also
told to stop (SIGTERM, Linux's parent-death signal) when the guard itself is killed outright: a container
whose processes were killed one by one left its vLLM servers running otherwise.

When the engine forkserver runs (``PDSERVE_ENGINE_FORKSERVER``, engine/forkserver.py) and CMD is vLLM's
server, the guard asks it for the server instead of starting one: the same command, environment and
output, forked from a process that has imported vLLM already. The server then leads a process group of its
own (its engine core is in it), which the guard signals and takes down as it would its own group. When the
forkserver cannot (none there, no answer, settings it does not share), CMD starts afresh.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from pdserve.engine.limits import apply_engine_limits, die_with_parent
from pdserve.settings import ENGINE_FORKSERVER_ENV

if TYPE_CHECKING:
    from pdserve.engine.forked import Forked


def _kill_group(sig: int) -> None:
    try:
        os.killpg(os.getpgid(0), sig)
    except ProcessLookupError:
        pass


def _forked(cmd: list[str]) -> Forked | None:
    """The server forked by the engine forkserver, or None when CMD is to start afresh."""
    path = os.environ.get(ENGINE_FORKSERVER_ENV)
    if not path:
        return None
    from pdserve.engine.forked import spawn

    if len(cmd) < 3 or cmd[1] != "-m" or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return None
    try:
        forked = spawn(path, cmd[2], cmd[3:], dict(os.environ))
    except (OSError, ValueError) as e:
        print(f"[pdserve] engine forkserver not used ({e}); starting the engine's server afresh",
              file=sys.stderr, flush=True)
        return None
    print(f"[pdserve] engine server forked by the engine forkserver: pid {forked.pid}", file=sys.stderr, flush=True)
    return forked


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m pdserve.engine.guard PARENT_PID -- CMD ...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    apply_engine_limits()
    forked = _forked(argv[2:])
    me = os.getpid()
    child = forked or subprocess.Popen(argv[2:], preexec_fn=(lambda: die_with_parent(me))
                                       if sys.platform == "linux" else None)

    def kill_all(sig: int) -> None:
        if forked is not None:
            forked.kill_group(sig)
        _kill_group(sig)

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
    wait = _Waiter(child.pid, parent)
    while True:
        rc = child.poll()
        if rc is not None:
            # The server is gone: take whatever it left in the group (engine core processes) too.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            kill_all(signal.SIGTERM)
            return rc
        if not stopping and os.getppid() != parent:
            stopping = True
            child.terminate()
            deadline = time.monotonic() + 10
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            kill_all(signal.SIGKILL)
            return 1
        wait()


class _Waiter:
    """Sleeps until the server or the guard's parent exits (Linux pidfds: no wake-ups while both run), or
    half a second where pidfds are missing. A signal's handler runs meanwhile; the loop looks again after
    every wake-up, so a spurious one costs nothing."""

    def __init__(self, server: int, parent: int) -> None:
        import selectors

        self.sel = selectors.DefaultSelector()
        watched = 0
        for pid in (server, parent):
            try:
                self.sel.register(os.pidfd_open(pid), selectors.EVENT_READ)
                watched += 1
            except (AttributeError, OSError):  # no pidfds (not Linux 5.3+), or the process is gone already
                pass
        self.timeout = None if watched == 2 else 0.5

    def __call__(self) -> None:
        for key, _ in self.sel.select(self.timeout):
            # That process exited: its pidfd stays readable. Looked at every half second from now on (the
            # server's exit ends the loop; the parent's, once the guard is stopping anyway, must not spin it).
            self.sel.unregister(key.fileobj)
            os.close(key.fd)
            self.timeout = 0.5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
