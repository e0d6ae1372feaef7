"""Finding engine processes on this host by their command line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from pdserve.engine.process import find_processes


def stub_server(status_of):
    """An HTTP server on loopback answering every GET and POST with ``status_of(headers)`` and no body."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status_of(self.headers))
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_find_processes_returns_pid_and_the_kernel_command_line():
    mark = f"pdserve-test-{uuid.uuid4().hex}"
    argv = [sys.executable, "-c", "import time; time.sleep(60)", mark, "two words", ""]
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 10
        while not (found := find_processes(b"no-such-mark", mark.encode())):
            assert time.monotonic() < deadline, "the child never showed up"
            time.sleep(0.05)
        assert found == [(proc.pid, b"".join(os.fsencode(a) + b"\0" for a in argv))]
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert found[0][1] == f.read()  # the same bytes the kernel has
    finally:
        proc.kill()
        proc.wait()
    assert find_processes(mark.encode()) == []
    assert find_processes(b"no-such-mark") == []


def test_server_pid_is_the_server_not_its_guard():
    """The guard's command line holds the server's (it starts it): a test or the soak that kills "the server"
    must get the server, or the engine keeps serving while its replica is replaced."""
    from pdserve.engine.process import server_pid

    port = str(40000 + uuid.uuid4().int % 20000)
    sleep = "import time; time.sleep(30)"
    server_args = ["vllm.entrypoints.openai.api_server", "--port", port]
    guard = subprocess.Popen([sys.executable, "-c", sleep, "pdserve.engine.guard", "1", "--", *server_args])
    time.sleep(0.2)
    server = subprocess.Popen([sys.executable, "-c", sleep, *server_args])
    try:
        for _ in range(50):
            if server_pid(f"http://127.0.0.1:{port}") == server.pid:
                break
            time.sleep(0.1)
        assert server_pid(f"http://127.0.0.1:{port}") == server.pid
    finally:
        guard.kill()
        server.kill()


def test_an_engine_that_answers_without_its_key_is_stopped_not_served(tmp_path):
    import pytest

    from pdserve.engine.process import EngineProcess
    from pdserve.errors import EngineStartError

    for status, ok in ((401, True), (200, False), (400, False)):
        srv = stub_server(lambda headers, status=status: status)
        try:
            engine = EngineProcess(None, f"http://127.0.0.1:{srv.server_port}", tmp_path / "e.log", "test engine")  # type: ignore[arg-type]
            if ok:
                engine.check_guarded()
            else:
                with pytest.raises(EngineStartError, match="without its key"):
                    engine.check_guarded()
        finally:
            srv.shutdown()


def test_a_guard_killed_outright_takes_its_command_down():
    """SIGKILL to the guard (a container's processes killed one by one) still stops the engine it runs: the
    engine gets SIGTERM as its parent dies."""
    import signal

    import psutil

    mark = f"pdserve-guarded-{uuid.uuid4().hex}"
    guard = subprocess.Popen([sys.executable, "-m", "pdserve.engine.guard", str(os.getpid()), "--",
                              sys.executable, "-c", "import time; time.sleep(120)", mark])
    try:
        deadline = time.monotonic() + 20
        # (the guard's own command line holds the mark too)
        while not (found := [pid for pid, _ in find_processes(mark.encode()) if pid != guard.pid]):
            assert time.monotonic() < deadline, "the guarded command never showed up"
            time.sleep(0.05)
        child = psutil.Process(found[0])
        guard.send_signal(signal.SIGKILL)
        guard.wait()
        child.wait(timeout=10)  # raises psutil.TimeoutExpired if it outlived its guard
    finally:
        guard.kill()
        for pid, _ in find_processes(mark.encode()):
            os.kill(pid, signal.SIGKILL)


def test_a_process_whose_parent_died_before_it_asked_to_die_with_it_ends_at_once():
    """The kernel's death signal covers only a parent that dies after the request: one started by a parent
    that is gone already (killed between its fork and the request) stops at once, with SIGTERM."""
    import signal

    code = ("import os, time; from pdserve.engine.limits import die_with_parent; "
            "die_with_parent(os.getppid()); die_with_parent(os.getppid() + 1); time.sleep(60)")
    done = subprocess.run([sys.executable, "-c", code], timeout=50)
    assert done.returncode == -signal.SIGTERM


def test_a_guard_stops_its_command_when_its_parent_goes_and_sleeps_until_then():
    """The guard's parent (an engine replica) is killed outright: the guard stops the command and exits.
    Until then it does not wake at all (it waits on the two processes' pidfds), so two idle engines' guards
    take nothing from a small host's cores."""
    import signal

    import psutil

    mark = f"pdserve-orphaned-{uuid.uuid4().hex}"
    # A parent that starts the guard in a session of its own (as an engine replica does), then waits.
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-m', 'pdserve.engine.guard', "
            "str(__import__('os').getpid()), '--', sys.executable, '-c', 'import time; time.sleep(120)', "
            f"{mark!r}], start_new_session=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(found := find_processes(mark.encode())) < 2:  # the guard and its command
            assert time.monotonic() < deadline, "the guard and its command never showed up"
            time.sleep(0.05)
        procs = [psutil.Process(pid) for pid, _ in found]
        guard = next(p for p in procs if b"pdserve.engine.guard" in dict(found)[p.pid])
        assert _settles_idle(guard)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        for p in procs:
            p.wait(timeout=20)  # raises psutil.TimeoutExpired if the guard or its command outlived the parent
    finally:
        parent.kill()
        for pid, _ in find_processes(mark.encode()):
            os.kill(pid, signal.SIGKILL)


def _settles_idle(p, windows: int = 5) -> bool:
    """Whether ``p`` goes 2 s without waking more than once, in one of ``windows`` tries (it may still be
    starting on a loaded host; a process on a timer wakes in every window)."""
    for _ in range(windows):
        before = p.num_ctx_switches().voluntary
        time.sleep(2.0)
        if p.num_ctx_switches().voluntary - before <= 1:
            return True
    return False


def test_an_engine_that_exits_by_itself_is_reported_and_one_stopped_is_not(tmp_path):
    """The watch an engine replica puts on its engine (app/deployments.py ends the replica on it, so Serve
    replaces it at once): an engine killed under its guard is reported with its exit status; one ended by
    :meth:`EngineProcess.stop` is not."""
    import signal
    import threading

    import psutil

    from pdserve.engine.launcher import EngineCommand
    from pdserve.engine.process import EngineProcess

    def started(name: str) -> tuple[EngineProcess, threading.Event, list[int]]:
        cmd = EngineCommand([sys.executable, "-c", "import time; time.sleep(60)"], {})
        engine = EngineProcess(cmd, "http://127.0.0.1:1", tmp_path / f"{name}.log", name)
        engine.start()
        exited, codes = threading.Event(), []
        engine.watch(lambda rc: (codes.append(rc), exited.set()))
        return engine, exited, codes

    killed, exited, codes = started("killed")
    try:
        deadline = time.monotonic() + 10
        while not (children := psutil.Process(killed.proc.pid).children()):  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the guard never started its command"
            time.sleep(0.05)
        os.kill(children[0].pid, signal.SIGKILL)
        assert exited.wait(10), "a killed engine was not reported"
        assert codes and codes[0] != 0, codes
        assert not killed.alive()
    finally:
        killed.stop()

    stopped, exited, codes = started("stopped")
    stopped.stop(grace_s=5)
    assert not stopped.alive()
    assert not exited.wait(1), f"an engine stop() ended was reported as exited by itself: {codes}"


def test_an_engine_whose_port_another_server_answers_does_not_pass_its_start(tmp_path):
    """Readiness asks the server at the engine's address for its models with the engine's own key: another
    engine that answers there (its /health is as good) refuses it, and the start fails, saying so."""
    import pytest

    from pdserve.engine.process import EngineProcess
    from pdserve.errors import EngineStartError

    srv = stub_server(lambda headers: 200 if headers.get("Authorization") == "Bearer mine" else 401)
    try:
        engine = EngineProcess(None, f"http://127.0.0.1:{srv.server_port}", tmp_path / "e.log", "test engine")  # type: ignore[arg-type]
        engine.check_own("mine")
        with pytest.raises(EngineStartError, match="is not this engine.*HTTP 401"):
            engine.check_own("another engine's key")
    finally:
        srv.shutdown()
