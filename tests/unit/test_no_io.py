"""The guard every unit test runs under (pdserve.testing.no_io; tests/unit/conftest.py): what it refuses, what
it leaves alone, and that a refusal the code under test swallowed still fails the test. Nothing here gets as
far as a socket or a process: the guard refuses before the real call."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading

import pytest
import zmq

from pdserve.testing.no_io import MESSAGE, NoIO, NoIOError


def test_inet_sockets_are_refused_with_where_the_test_belongs():
    with NoIO("tests/component") as guard:
        for family, address in ((socket.AF_INET, ("127.0.0.1", 0)), (socket.AF_INET6, ("::1", 0))):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                with pytest.raises(NoIOError, match="move this test to tests/component"):
                    s.bind(address)
                with pytest.raises(NoIOError):
                    s.connect(address)
                with pytest.raises(NoIOError):
                    s.connect_ex(address)
    assert len(guard.attempts) == 6
    assert str(guard.attempts[0]).startswith("socket.bind(('127.0.0.1', 0))")
    with pytest.raises(NoIOError, match=MESSAGE):
        guard.check()


def test_processes_are_refused():
    with NoIO("tests/component") as guard:
        with pytest.raises(NoIOError, match="subprocess.Popen"):
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        with pytest.raises(NoIOError, match="os.fork"):
            os.fork()

        async def child() -> None:
            await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")

        with pytest.raises(NoIOError):
            asyncio.run(child())
    assert len(guard.attempts) == 3


def test_zmq_sockets_are_refused_but_inproc():
    ctx = zmq.Context()
    try:
        with NoIO("tests/component") as guard:
            pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
            with pytest.raises(NoIOError):
                pub.bind("tcp://127.0.0.1:5555")
            with pytest.raises(NoIOError):
                sub.connect("ipc:///tmp/never.sock")
            pub.bind("inproc://unit")
            sub.connect("inproc://unit")
            pub.close(linger=0)
            sub.close(linger=0)
        assert len(guard.attempts) == 2
    finally:
        ctx.term()


def test_unix_sockets_and_the_event_loop_stay_open():
    with NoIO("tests/component") as guard:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(b"x")
            assert b.recv(1) == b"x"

        async def tick() -> int:
            await asyncio.sleep(0)
            return 1

        assert asyncio.run(tick()) == 1
    guard.check()
    assert guard.attempts == []


def test_a_refusal_swallowed_in_a_thread_the_test_started_still_counts():
    def quietly() -> None:
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=1)
        except Exception:
            pass  # what a server thread does with its errors

    with NoIO("tests/component") as guard:
        t = threading.Thread(target=quietly)
        t.start()
        t.join()
    with pytest.raises(NoIOError, match="socket.connect"):
        guard.check()


def test_threads_older_than_the_guard_are_not_this_tests_doing():
    """Another test's leftover thread is left alone (asked directly: a real socket would meet the conftest's
    guard, under which this thread is new)."""
    go, done = threading.Event(), threading.Event()
    outcome: list[str] = []
    guard = NoIO("tests/component")

    def leftover() -> None:
        go.wait()
        try:
            guard._refuse("socket.connect(('127.0.0.1', 8000))")
            outcome.append("let through")
        except NoIOError:
            outcome.append("refused")
        done.set()

    old = threading.Thread(target=leftover, daemon=True)
    old.start()
    with guard:
        go.set()
        assert done.wait(10)
        with pytest.raises(NoIOError):  # the test's own (main) thread is never exempt
            guard._refuse("socket.connect(('127.0.0.1', 8000))")
    assert outcome == ["let through"] and len(guard.attempts) == 1


def test_everything_is_given_back_on_exit():
    before = (socket.socket.bind, socket.socket.connect, subprocess.Popen.__init__, os.fork, zmq.Socket.bind)
    with NoIO("tests/component"):
        assert socket.socket.bind is not before[0]
    assert (socket.socket.bind, socket.socket.connect, subprocess.Popen.__init__, os.fork,
            zmq.Socket.bind) == before
