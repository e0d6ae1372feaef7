"""The guard's side of the engine forkserver (engine/forkserver.py): ask it for a server, and hold that
server as a guard holds the one it started itself; and the messages both sides exchange (a 4-byte length,
then JSON)."""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import time
from typing import Any

#: How long a guard waits for the forkserver's answer (it may still be importing) before starting its
#: server afresh.
ANSWER_TIMEOUT_S = 120.0
LEN = struct.Struct("!I")
MAX_MESSAGE = 4 << 20


class Forked:
    """A server forked for this guard: the interface the guard uses of a ``subprocess.Popen``."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn = conn
        self.pid = pid
        self.returncode: int | None = None
        self._buf = b""

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(None)
        if self.returncode is None and not alive(self.pid):
            # Reaped: its exit code is on its way (the forkserver reaps, then writes), unless the forkserver
            # stopped (and told its servers to stop with it).
            self._read(1.0)
            if self.returncode is None:
                self.returncode = 1
        return self.returncode

    def _read(self, wait_s: float | None) -> None:
        """The exit message if it came (``wait_s``: how long to wait for it; None: not at all)."""
        if wait_s is None:
            self.conn.setblocking(False)
        else:
            self.conn.settimeout(wait_s)
        try:
            while (got := message(self._buf)) is None:
                chunk = self.conn.recv(4096)
                if not chunk:
                    return
                self._buf += chunk
            self.returncode = int(got[0].get("exit", 1))
        except OSError:  # nothing yet (BlockingIOError, timeout), or the forkserver is gone
            pass

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill_group(self, sig: int) -> None:
        """The server's process group: the server and its engine core."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited one not yet reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b")")[-1].split()[0] != b"Z"
    except OSError:
        return False


def spawn(path: str, module: str, args: list[str], env: dict[str, str], timeout_s: float = ANSWER_TIMEOUT_S
          ) -> Forked:
    """Ask the forkserver at ``path`` for ``python -m MODULE ARGS`` with ``env``; it gets this process's
    stdin, stdout and stderr and working directory. Raises ``OSError`` when it cannot (no forkserver, no
    answer in time, another module, settings it does not share): the caller starts the server afresh."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout_s)
        conn.connect(path)
        body = json.dumps({"module": module, "args": args, "env": env, "cwd": os.getcwd()}).encode()
        fds = array.array("i", [0, 1, 2])
        conn.sendmsg([LEN.pack(len(body)) + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        buf = b""
        deadline = time.monotonic() + timeout_s
        while (got := message(buf)) is None:
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            chunk = conn.recv(4096)
            if not chunk:
                raise OSError("the engine forkserver closed the connection without forking")
            buf += chunk
        answer, rest = got
        if "pid" not in answer:
            raise OSError(f"the engine forkserver refused: {answer.get('error', answer)}")
        forked = Forked(conn, int(answer["pid"]))
        forked._buf = rest
        return forked
    except BaseException:
        conn.close()
        raise


def message(buf: bytes) -> tuple[dict[str, Any], bytes] | None:
    """The first whole message in ``buf`` and what follows it; None while it is incomplete."""
    if len(buf) < LEN.size:
        return None
    (n,) = LEN.unpack_from(buf)
    if n > MAX_MESSAGE:
        raise OSError(f"engine forkserver message of {n} bytes")
    if len(buf) < LEN.size + n:
        return None
    return json.loads(buf[LEN.size:LEN.size + n]), buf[LEN.size + n:]
