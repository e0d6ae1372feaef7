"""The guard that keeps unit tests units: no network socket, no process.

While a :class:`NoIO` is active, a test (or anything it runs, in its own thread or one it starts) that binds
or connects an INET socket (IPv4 or IPv6), binds or connects a ZeroMQ socket other than ``inproc://``, or
starts a process (``subprocess``, ``asyncio``'s subprocesses, ``os.fork``/``posix_spawn``/``system``,
``multiprocessing``) gets :class:`NoIOError`, and the attempt is recorded: :meth:`NoIO.check` raises it
again once the test phase is over, in case the code under test swallowed the error.

Unix sockets stay open to everyone: ``asyncio`` builds its event loop's self-pipe from a socket pair.
Threads that were already running when the guard started are left alone (another test's leftovers are
not this test's doing). tests/unit/conftest.py and bench/tests/conftest.py put every test under it, with
:func:`guard_phase` in their hooks.
"""

from __future__ import annotations

import multiprocessing.util
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Generator
from typing import Any

#: What a guarded test is told; the conftest adds where such tests go.
MESSAGE = "unit tests open no sockets and start no processes"

_INET = (socket.AF_INET, socket.AF_INET6)


class NoIOError(RuntimeError):
    """A guarded test reached for the network or a process."""


class NoIO:
    """Patches the calls that open sockets or start processes for as long as it is entered.

    ``where``: the directory such tests belong in, named in the message."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.attempts: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._before: set[threading.Thread] = set()

    # -- what is refused ---------------------------------------------------------------------------------

    def _refuse(self, what: str) -> None:
        """Record ``what`` and raise, unless the calling thread predates the guard."""
        me = threading.current_thread()
        if me in self._before and me is not threading.main_thread():
            return
        self.attempts.append(what)
        raise NoIOError(self.message(what))

    def message(self, what: str) -> str:
        return f"{MESSAGE}: move this test to {self.where} (it tried: {what})"

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        real = getattr(owner, name, None)
        if real is None:
            return
        self._saved.append((owner, name, real))
        setattr(owner, name, make(real))

    def _socket_call(self, name: str) -> Callable[[Any], Any]:
        guard = self

        def make(real: Any) -> Any:
            def guarded(sock: socket.socket, address: Any, *a: Any, **kw: Any) -> Any:
                if sock.family in _INET:
                    guard._refuse(f"socket.{name}({address!r})")
                return real(sock, address, *a, **kw)
            return guarded
        return make

    def _process_call(self, label: str) -> Callable[[Any], Any]:
        guard = self

        def make(real: Any) -> Any:
            def guarded(*a: Any, **kw: Any) -> Any:
                shown = a[1] if label == "subprocess.Popen" and len(a) > 1 else (a[0] if a else kw.get("args"))
                guard._refuse(f"{label}({str(shown)[:200]})")
                return real(*a, **kw)
            return guarded
        return make

    def _zmq_call(self, name: str) -> Callable[[Any], Any]:
        guard = self

        def make(real: Any) -> Any:
            def guarded(sock: Any, address: Any, *a: Any, **kw: Any) -> Any:
                if not str(address).startswith("inproc://"):
                    guard._refuse(f"zmq.Socket.{name}({address!r})")
                return real(sock, address, *a, **kw)
            return guarded
        return make

    # -- entering and leaving ----------------------------------------------------------------------------

    def __enter__(self) -> NoIO:
        self._before = set(threading.enumerate())
        for name in ("bind", "connect", "connect_ex"):
            self._patch(socket.socket, name, self._socket_call(name))
        self._patch(subprocess.Popen, "__init__", self._process_call("subprocess.Popen"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            self._patch(os, name, self._process_call(f"os.{name}"))
        self._patch(multiprocessing.util, "spawnv_passfds", self._process_call("multiprocessing"))
        try:
            import zmq
        except ImportError:  # pragma: no cover - pyzmq is one of pdserve's dependencies
            zmq = None
        if zmq is not None:
            for name in ("bind", "connect"):
                self._patch(zmq.Socket, name, self._zmq_call(name))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._saved:
            owner, name, real = self._saved.pop()
            setattr(owner, name, real)

    def check(self) -> None:
        """Raise :class:`NoIOError` if anything was refused (even if the code under test caught it)."""
        if self.attempts:
            seen = list(dict.fromkeys(self.attempts))
            more = f"; and {len(seen) - 5} more" if len(seen) > 5 else ""
            raise NoIOError(self.message("; ".join(seen[:5]) + more))


def guard_phase(where: str) -> Generator[None, Any, Any]:
    """The body of a pytest hook wrapper (``pytest_runtest_setup``, ``_call``, ``_teardown``) that runs the
    phase under a :class:`NoIO`: ``return (yield from guard_phase(where))``."""
    guard = NoIO(where)
    with guard:
        try:
            result = yield
        except BaseException:
            guard.check()  # a refused socket or process is the cause: say so rather than what followed
            raise
    guard.check()
    return result
