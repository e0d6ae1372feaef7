"""One real system per test session: `pdserve serve` (Ray Serve + 2 vLLM CPU engines + NIXL), started the
way a user starts it, as a subprocess, and stopped with SIGINT at the end."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from pdserve.engine.process import GUARD_MARK, SERVER_MARK, find_processes
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600


def engine_processes() -> list[int]:
    return [pid for pid, _ in find_processes(SERVER_MARK, GUARD_MARK)]


class ServeProcess:
    def __init__(self, config: Path | None, port: int, *, prefix: Sequence[str] = (), args: Sequence[str] = (),
                 host: str = "127.0.0.1") -> None:
        """``prefix`` runs the command under another one (e.g. ``ip netns exec NS``); ``args`` are more
        ``pdserve serve`` options; ``host`` is where this process reaches the endpoint."""
        self.port = port
        self.url = f"http://{host}:{port}"
        cmd = [*prefix, str(Path(sys.executable).parent / "pdserve"), "serve", "--port", str(port), *args]
        if config is not None:
            cmd.insert(len(prefix) + 2, str(config))
        self.preexisting = set(engine_processes())
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                                     stdin=subprocess.DEVNULL, text=True)
        self.lines: deque[str] = deque(maxlen=400)
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            sys.stderr.write("  | " + line)
            if line.startswith("pdserve ready:"):
                self.ready.set()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("pdserve serve did not become ready:\n" + "\n".join(self.lines))

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def status(self) -> dict:
        return httpx.get(self.url + "/pdserve/status", timeout=10).json()

    def engine_url(self, role: str) -> str:
        return next(e["url"] for e in self.status()["engines"] if e["role"] == role)


@pytest.fixture(scope="session")
def served() -> ServeProcess:
    sp = ServeProcess(ROOT / "tests" / "integration" / "pd-test.yaml", free_port())
    sp.wait_ready()
    yield sp
    sp.stop()
