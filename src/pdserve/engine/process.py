"""One vLLM OpenAI server process: start it, wait until it answers, stop it with all its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path
from threading import Thread
from typing import Any

import psutil

from pdserve.engine.launcher import EngineCommand
from pdserve.errors import EngineStartError

#: Command-line markers of the processes an engine consists of.
GUARD_MARK = b"pdserve.engine.guard"
SERVER_MARK = b"vllm.entrypoints.openai.api_server"


def find_processes(*marks: bytes) -> list[tuple[int, bytes]]:
    """(pid, NUL-separated command line) of this host's processes whose command line holds any mark.

    The command line is in the kernel's own form: every argument followed by a NUL byte. Processes that
    vanish or may not be read while the scan runs are left out.
    """
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"]  # None when access is denied or the process is gone
        if not argv:
            continue
        cmd = b"".join(os.fsencode(arg) + b"\0" for arg in argv)
        if any(m in cmd for m in marks):
            found.append((proc.pid, cmd))
    return found


def _port_of(cmd: bytes) -> bytes | None:
    """The ``--port`` of a command line (the kernel's form; a server forked by the engine forkserver is
    retitled to its command as one string, its arguments apart by spaces)."""
    args = cmd.replace(b" ", b"\0").split(b"\0")
    if b"--port" in args[:-1]:
        return args[args.index(b"--port") + 1] or None
    return None


def server_pid(url: str) -> int | None:
    """The pid of the vLLM server on this host that answers at ``url`` (matched by its ``--port``)."""
    from urllib.parse import urlsplit

    port = str(urlsplit(url).port).encode()
    for pid, cmd in find_processes(SERVER_MARK):
        if GUARD_MARK not in cmd and _port_of(cmd) == port:
            # (a guard's command line holds its server's: it is the server's parent, not the server)
            return pid
    return None


def local_engine_auth(url: str) -> dict[str, str]:
    """The headers that let a caller on the engine's own host, running as the engine's user, past its key
    guard: the key is in the environment of the engine's guard (which gives it to the server). For tools
    that measure or test a local app's engines directly (the bare-handoff benchmark, integration tests);
    ``{}`` when the engine has no key."""
    from urllib.parse import urlsplit

    from pdserve.engine.launcher import ENGINE_KEY_ENV

    port = str(urlsplit(url).port).encode()
    pids = [pid for pid, cmd in find_processes(GUARD_MARK) if _port_of(cmd) == port]
    for pid in pids or [p for p in [server_pid(url)] if p is not None]:
        try:
            key = psutil.Process(pid).environ().get(ENGINE_KEY_ENV)
        except psutil.Error:
            continue
        return {"Authorization": f"Bearer {key}"} if key else {}
    return {}


class EngineProcess:
    """A vLLM server in its own process group, its output kept in a log file and a short tail in memory."""

    def __init__(self, cmd: EngineCommand, url: str, log_path: Path, name: str) -> None:
        self.cmd = cmd
        self.url = url
        self.log_path = log_path
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.tail: deque[str] = deque(maxlen=60)
        self._stopping = False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.cmd.env}
        argv = [sys.executable, "-m", "pdserve.engine.guard", str(os.getpid()), "--", *self.cmd.argv]
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        Thread(target=self._pump, name=f"{self.name}-log", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        pump_lines(self.proc.stdout, self.log_path, self.tail.append)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def watch(self, on_exit: Callable[[int], None]) -> None:
        """Call ``on_exit(returncode)``, from a thread of its own, when the engine exits by itself (killed,
        crashed, out of memory); never when :meth:`stop` ends it."""
        proc = self.proc
        assert proc is not None, "start() first"

        def wait() -> None:
            rc = proc.wait()
            if not self._stopping:
                on_exit(rc)

        Thread(target=wait, name=f"{self.name}-watch", daemon=True).start()

    def healthy(self, timeout: float = 5.0) -> bool:
        if not self.alive():
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout_s: float) -> float:
        """Block until ``/health`` answers 200; return the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise EngineStartError(
                    f"{self.name} exited with code {self.proc.returncode if self.proc else '?'} during startup; "
                    f"log: {self.log_path}\n" + "\n".join(list(self.tail)[-25:])
                )
            if self.healthy(timeout=2.0):
                return time.monotonic() - t0
            time.sleep(0.5)
        self.stop()
        raise EngineStartError(f"{self.name} not ready after {timeout_s:.0f}s; log: {self.log_path}")

    def check_own(self, api_key: str, path: str = "/v1/models") -> None:
        """The server answering at this engine's address is this engine: it takes this engine's own key.
        Another engine on the same port (ports are claimed per host, pdserve/engine/allocator.py, but a
        process outside pdserve may take one) answers ``/health`` as well, but refuses the key; then this
        engine is stopped and :class:`EngineStartError` says so, rather than registering an address whose
        answers come from someone else."""
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=10):
                return
        except urllib.error.HTTPError as e:
            why = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            why = str(e)
        self.stop()
        raise EngineStartError(f"{self.name}: the server answering at {self.url} is not this engine ({path} with "
                               f"its own key: {why}); another process serves that port. Log: {self.log_path}")

    def check_guarded(self, path: str = "/tokenize") -> None:
        """Fail closed: an engine started with a key must refuse ``path`` without it (pdserve's vLLM endpoint
        plugin puts every path but health and metrics behind the key). An engine that answers anyway (the
        plugin did not load) is stopped and :class:`EngineStartError` says why."""
        req = urllib.request.Request(self.url + path, data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10):
                status = 200
        except urllib.error.HTTPError as e:
            status = e.code
        except (urllib.error.URLError, OSError) as e:
            status = -1
            why = str(e)
        if status == 401:
            return
        self.stop()
        raise EngineStartError(f"{self.name} answered {path} without its key ("
                               f"{'HTTP ' + str(status) if status > 0 else why}): pdserve's vLLM endpoint plugin "
                               "is not loaded there (check VLLM_PLUGINS and that pdserve is installed in the "
                               "engine's environment); not serving an open engine")

    def stop(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass



def pump_lines(stream: Any, log_path: Path, on_line: Callable[[str], None]) -> None:
    """Copy a child's output to ``log_path`` line by line as it comes, handing each line (decoded, without
    its end) to ``on_line``; returns when the child closes it."""
    with open(log_path, "ab") as f:
        for line in stream:
            f.write(line)
            f.flush()
            on_line(line.decode(errors="replace").rstrip())
