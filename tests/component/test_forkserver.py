"""The engine forkserver with a stand-in server module (tests/component/fork_target.py): an engine's guard
gets its server forked from the pre-imported process, with the engine's arguments, environment, output,
cores and own process group; signals, exit codes and stops go as with a server the guard started itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine import forked, forkserver
from pdserve.settings import ENGINE_CORES_ENV, ENGINE_FORKSERVER_ENV, FORKSERVER_CHECKED_ENV

ROOT = Path(__file__).resolve().parents[2]
TARGET = "tests.component.fork_target"


def _alive(pid: int) -> bool:
    return forked.alive(pid)


def _wait(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture()
def server(tmp_path):
    """A forkserver of the stand-in module, started with one checked setting (SHARED=yes)."""
    path = str(tmp_path / "forks.sock")
    env = {**os.environ, "SHARED": "yes", FORKSERVER_CHECKED_ENV: "SHARED"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.forkserver", path, TARGET], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, text=True)
    assert "ready" in proc.stderr.readline()
    yield proc, path
    proc.terminate()
    proc.wait(timeout=30)


def _guard(path: str, *args: str, shared: str = "yes", **env: str) -> subprocess.Popen:
    full = {**os.environ, ENGINE_FORKSERVER_ENV: path, "SHARED": shared, **env}
    return subprocess.Popen([sys.executable, "-m", "pdserve.engine.guard", str(os.getpid()), "--",
                             sys.executable, "-m", TARGET, *args], cwd=ROOT, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_a_forked_server_is_the_engines_own_process(server, tmp_path):
    """Forked from the process that imported the module: the engine's arguments, environment, working
    directory, cores and output; its own process group; its command line the engine's. SIGTERM to the
    guard reaches the server and its exit code comes back as the guard's."""
    fs, path = server
    cores = sorted(os.sched_getaffinity(0))[:1]
    guard = _guard(path, "--port", "1234", "--x", "a b", FORK_TEST_VAR="engine-1",
                   **{ENGINE_CORES_ENV: str(cores[0])})
    seen = json.loads(guard.stdout.readline())
    assert seen["ppid"] == fs.pid and seen["imported_by"] == fs.pid
    assert seen["argv"] == ["--port", "1234", "--x", "a b"] and seen["var"] == "engine-1"
    assert seen["cwd"] == str(ROOT) and seen["pgid"] == seen["pid"] and seen["affinity"] == cores
    assert f"-m {TARGET} --port 1234" in seen["cmdline"]
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(timeout=20) == 3
    assert not _alive(seen["pid"])
    assert "forked by the engine forkserver" in guard.stderr.read()


def test_a_guard_killed_outright_takes_its_forked_server_with_it(server):
    _, path = server
    guard = _guard(path)
    pid = json.loads(guard.stdout.readline())["pid"]
    guard.kill()
    guard.wait()
    _wait(lambda: not _alive(pid))


def test_an_engine_with_other_import_time_settings_starts_afresh(server):
    """A setting the forkserver read at its start differs: the server is started by the guard itself."""
    _, path = server
    guard = _guard(path, shared="no")
    seen = json.loads(guard.stdout.readline())
    assert seen["ppid"] == guard.pid and seen["imported_by"] != server[0].pid
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(timeout=20) == 3
    assert "settings read at import differ from its own: SHARED" in guard.stderr.read()


def test_no_forkserver_there_starts_the_server_afresh(tmp_path):
    guard = _guard(str(tmp_path / "none.sock"))
    seen = json.loads(guard.stdout.readline())
    assert seen["ppid"] == guard.pid
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(timeout=20) == 3


def test_a_stopping_forkserver_stops_its_servers(server):
    fs, path = server
    guard = _guard(path)
    pid = json.loads(guard.stdout.readline())["pid"]
    fs.terminate()
    assert fs.wait(timeout=30) == 0
    _wait(lambda: not _alive(pid))
    assert guard.wait(timeout=20) != 0  # the guard sees its server gone


def test_an_idle_forkserver_sleeps_until_something_happens(server):
    """No timer: with no request and no child, it does not wake at all (it would take a little of a small
    host's cores for as long as the app runs)."""
    import psutil

    from tests.component.test_process import _settles_idle

    fs, _ = server
    assert _settles_idle(psutil.Process(fs.pid))


def test_what_a_killed_server_leaves_in_its_group_is_killed_too(server):
    """A server killed outright (SIGKILL) leaves its engine core, which may not stop on SIGTERM (vLLM's drains
    first, and with its server gone waits forever): the forkserver kills the group after the grace."""
    _, path = server
    guard = _guard(path, "--stubborn-child")
    seen = json.loads(guard.stdout.readline())
    os.kill(seen["pid"], signal.SIGKILL)
    assert guard.wait(timeout=20) != 0
    _wait(lambda: not _alive(seen["grandchild"]), timeout=forkserver.LEFTOVER_GRACE_S + 10)
