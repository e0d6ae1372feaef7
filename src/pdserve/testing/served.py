"""``pdserve serve`` as a child process: the one way the benchmarks and the integration tests start an app.

It writes the config (when given as :class:`PDServeArgs`), starts ``pdserve serve`` on a free port, keeps
every output line with the time it arrived, says when the app is ready, and stops it with a signal as a
user would (SIGINT by default), waiting for it to exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdserve.errors import EngineStartError
from pdserve.testing.thread_server import free_port  # noqa: F401 (also named here: tests and the bench import it)

#: The line ``pdserve serve`` prints on stdout once the endpoint answers.
READY_PREFIX = "pdserve ready:"


class ServedProcess:
    """One ``pdserve serve`` child process.

    ``config``: a YAML path, or :class:`~pdserve.config.schema.PDServeArgs` written to a temporary file (its
    non-default fields), or None for the embedded default. ``argv``: more ``serve`` options. ``prefix``:
    a command to run it under (e.g. ``ip netns exec NS``). ``host``: where this process reaches the endpoint.
    ``echo``: called with each output line as it arrives.
    """

    def __init__(self, config: Any = None, *, port: int | None = None, argv: Sequence[str] = (),
                 prefix: Sequence[str] = (), host: str = "127.0.0.1", echo: Callable[[str], None] | None = None,
                 cwd: str | Path | None = None) -> None:
        self.config = config
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.argv = list(argv)
        self.prefix = list(prefix)
        self.echo = echo
        self.cwd = cwd
        #: (monotonic time, line) for every output line, stdout and stderr together.
        self.timed_lines: list[tuple[float, str]] = []
        self.started_at = 0.0
        self.proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._tmp: Path | None = None
        self._reader: threading.Thread | None = None

    @property
    def lines(self) -> list[str]:
        return [text for _, text in self.timed_lines]

    def command(self) -> list[str]:
        cmd = [*self.prefix, str(Path(sys.executable).parent / "pdserve"), "serve"]
        if self.config is not None:
            cmd.append(self._config_path())
        return [*cmd, "--port", str(self.port), *self.argv]

    def _config_path(self) -> str:
        if isinstance(self.config, (str, Path)):
            return str(self.config)
        if self._tmp is None:
            import yaml

            fd, name = tempfile.mkstemp(suffix=".yaml", prefix="pdserve-served-")
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(self.config.model_dump(mode="json", exclude_defaults=True), f)
            self._tmp = Path(name)
        return str(self._tmp)

    def start(self) -> ServedProcess:
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1, cwd=self.cwd)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            text = line.rstrip()
            self.timed_lines.append((time.monotonic(), text))
            if self.echo is not None:
                self.echo(text)
            if text.startswith(READY_PREFIX):
                self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout_s: float = 600, poll: Callable[[], None] | None = None) -> float:
        """Seconds from start until ready. ``poll`` is called about every 0.1 s while waiting (progress).
        On exit or timeout the app is stopped and :class:`EngineStartError` carries its last lines."""
        assert self.proc is not None, "start() first"
        deadline = self.started_at + timeout_s
        while not self._ready.wait(0.1):
            if poll is not None:
                poll()
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with {self.proc.returncode}" if self.proc.poll() is not None
                       else f"not ready after {timeout_s:.0f}s")
                self.stop()
                raise EngineStartError(f"pdserve serve {why}:\n" + "\n".join(self.lines[-40:]))
        return next(t for t, text in self.timed_lines if text.startswith(READY_PREFIX)) - self.started_at

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 120, group: bool = False) -> int:
        """Send ``sig`` and wait for the exit (SIGKILL after ``timeout_s``); the exit status. ``group``: to
        every process under ``pdserve serve`` in its process group too, as a terminal's Ctrl-C, ``timeout``
        or ``kill -- -PGID`` would (this process, which shares the group, is left out)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            for pid in self._in_group() if group else [self.proc.pid]:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None
        return int(self.proc.returncode)

    def _in_group(self) -> list[int]:
        """``pdserve serve`` and the processes under it that share its process group."""
        import psutil

        assert self.proc is not None
        try:
            pgid = os.getpgid(self.proc.pid)
            under = psutil.Process(self.proc.pid).children(recursive=True)
        except (ProcessLookupError, psutil.Error):
            return [self.proc.pid]
        out = [self.proc.pid]
        for p in under:
            try:
                if os.getpgid(p.pid) == pgid:
                    out.append(p.pid)
            except ProcessLookupError:
                continue
        return out

    def __enter__(self) -> ServedProcess:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
