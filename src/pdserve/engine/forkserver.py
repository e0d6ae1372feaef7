"""One process that imports vLLM's OpenAI server once and forks every CPU engine's server of its host from it.

A CPU engine is two processes: vLLM's API server, and its engine core, which the API server forks
(``_site/sitecustomize.py``, 4). Started afresh, each API server imports torch and vLLM itself: seconds of a
core per engine, and each holds its own copy of what the imports built. ``pdserve serve`` starting a local
Ray instance on a host with no GPU starts this forkserver first (``cpu.fork_engines``,
engine/local_forkserver.py): it imports the server's module while Ray starts, freezes what it built
(``gc.freeze``: a collection in a child then writes to none of those pages), and waits. An engine's guard
(engine/guard.py) then asks it for the server instead of starting one: the forkserver forks, and the child
takes the guard's environment, output and working directory, and runs the module as ``__main__`` with the
engine's arguments, as a fresh process would. Before it forks the first engine of a model, it packs the
model's weights for oneDNN, which the engines then inherit instead of each packing its own
(``cpu.share_weights: packed``, engine/prepack.py).
Measured with the packaged model on a 2-core AMD EPYC (AVX2): the app 5.17 GiB PSS instead of 5.49 (the
forkserver's 0.29 included), ready in 24 s instead of 36 (``pdserve bench --scenario footprint`` /
``--scenario startup``).

What stays as with a fresh server: the guard owns the server, forwards its signals and takes it down with
its replica; the server leads its own process group (its engine core is in it); its command line reads as
the engine's (``ps``, :func:`pdserve.engine.process.server_pid`), retitled. What the forkserver adds: it
takes down a server whose guard is gone (the guard's connection closes), and every server when it stops
itself (Linux's parent-death signal, set in each child).

Protocol (one connection per server, a Unix socket only this user may open; the guard's side is
engine/forked.py): the guard sends one message, a 4-byte length and the JSON ``{"module": ..., "args":
[...], "env": {...}, "cwd": "..."}`` with its stdin, stdout and
stderr attached (``SCM_RIGHTS``); the forkserver answers ``{"pid": N}`` once it has forked, and
``{"exit": RC}`` when that server has exited. The engine's environment must hold what the forkserver was
started with for every setting read at import (:func:`common_env`): only per-engine values may differ.
"""

from __future__ import annotations

import array
import json
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine import prepack
from pdserve.engine.forked import LEN, message
from pdserve.engine.limits import apply_engine_limits, die_with_parent
from pdserve.settings import (
    ENGINE_CORES_ENV,
    ENGINE_KEY_ENV,
    ENGINE_NICE_ENV,
    FORKSERVER_CHECKED_ENV,
    KV_EVENTS_CURVE_ENV,
    KV_EVENTS_FILE_ENV,
    PACKED_WEIGHTS_ENV,
)

#: The module the forkserver imports and each child runs as ``__main__``.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: What an engine core imports after its server forked it (its scheduler, CPU worker, attention and NIXL
#: connector: ~850 modules), imported here as well: shared, and off the engine's start. One that fails to
#: import is left to the engine.
ALSO_IMPORTED = ("vllm.v1.engine.core", "vllm.v1.worker.cpu_worker", "vllm.v1.attention.backends.cpu_attn",
                 "vllm.v1.core.sched.scheduler", "vllm.distributed.kv_transfer.kv_connector.v1.nixl")
#: How long a server whose guard went away has to stop after SIGTERM before SIGKILL.
STOP_GRACE_S = 10.0
#: How long what an exited server left in its group (an orphaned engine core, which holds the server's
#: listening socket: connections to the engine's port hang meanwhile) has after SIGTERM before SIGKILL.
LEFTOVER_GRACE_S = 2.0
#: Engine settings that may differ between the engines forked from one forkserver: read by vLLM, the
#: connector or pdserve's engine fixes after the fork. Every other setting of an engine's environment is
#: read at import (torch, vLLM, the engine fixes) and must be the forkserver's own.
PER_ENGINE = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "OTEL_SERVICE_NAME", "VLLM_API_KEY",
              "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", KV_EVENTS_FILE_ENV, ENGINE_CORES_ENV, ENGINE_NICE_ENV,
              ENGINE_KEY_ENV, KV_EVENTS_CURVE_ENV, PACKED_WEIGHTS_ENV)


def common_env(engine_env: dict[str, str]) -> dict[str, str]:
    """The part of an engine's environment (``launcher.engine_env``) a forkserver is started with."""
    return {k: v for k, v in engine_env.items() if k not in PER_ENGINE}


def mismatched(env: dict[str, str], started: dict[str, str]) -> list[str]:
    """Settings read at import whose value in ``env`` (an engine's) differs from the forkserver's
    (``started``: the forkserver's environment): an engine with any of them must start afresh."""
    checked = [k for k in started.get(FORKSERVER_CHECKED_ENV, "").split(",") if k]
    return sorted(k for k in checked if env.get(k) != started.get(k))


# -- the forkserver ----------------------------------------------------------------------------------------------


def _send(conn: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    try:
        conn.setblocking(True)
        conn.sendall(LEN.pack(len(body)) + body)
    except OSError:
        pass  # the guard is gone; its server is being stopped


@dataclass
class _Child:
    conn: socket.socket
    stop_by: float | None = None  # SIGKILL then, once its guard went away


@dataclass
class _Server:
    listener: socket.socket
    module: str
    started: dict[str, str]
    children: dict[int, _Child] = field(default_factory=dict)
    #: Process groups of reaped servers (their engine cores) -> when they get SIGKILL if still there.
    leftovers: dict[int, float] = field(default_factory=dict)
    sel: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    stopping: bool = False
    #: Written to by every signal this process handles (a child's exit, a stop): an idle forkserver sleeps
    #: until one comes, with no timer.
    wake: tuple[socket.socket, socket.socket] = field(default_factory=socket.socketpair)

    def run(self) -> int:
        self.sel.register(self.listener, selectors.EVENT_READ)
        for end in self.wake:
            end.setblocking(False)
        self.sel.register(self.wake[0], selectors.EVENT_READ, "wake")
        signal.set_wakeup_fd(self.wake[1].fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler: the signal reaches the wake socket
        while not self.stopping:
            deadlines = [c.stop_by for c in self.children.values() if c.stop_by is not None]
            deadlines += list(self.leftovers.values())
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for key, _ in self.sel.select(timeout=timeout):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.data == "wake":
                    try:
                        self.wake[0].recv(4096)
                    except BlockingIOError:
                        pass
                else:
                    self._guard_closed(key.data)
            self._reap()
        for pid in list(self.children):
            _killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while (self.children or self.leftovers) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.1)
        for pgid in [*self.children, *self.leftovers]:
            _killpg(pgid, signal.SIGKILL)
        return 0

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(10.0)
            request, fds = _receive(conn)
            bad = mismatched(request["env"], self.started)
            why = (f"it serves {self.module}, not {request.get('module')}" if request.get("module") != self.module
                   else f"settings read at import differ from its own: {', '.join(bad)}" if bad else None)
            if why is not None:
                _send(conn, {"error": why})
                conn.close()
                for fd in fds:
                    os.close(fd)
                return
        except (OSError, ValueError, KeyError, TypeError) as e:
            _send(conn, {"error": f"bad request: {e}"})
            conn.close()
            return
        try:
            prepack.prepare(request["env"], [str(a) for a in request["args"]])
        except Exception as e:  # noqa: BLE001 - the engine then packs its own copy, as vLLM does
            print(f"[pdserve] engine forkserver: weights not packed ahead ({type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, self, conn, me)  # never returns
        for fd in fds:
            os.close(fd)
        self.children[pid] = _Child(conn)
        _send(conn, {"pid": pid})
        self.sel.register(conn, selectors.EVENT_READ, pid)

    def _guard_closed(self, pid: int) -> None:
        child = self.children.get(pid)
        if child is None:
            return
        try:
            child.conn.setblocking(False)
            if child.conn.recv(4096):
                return  # nothing more is expected from a guard; ignore it
        except BlockingIOError:
            return
        except OSError:
            pass
        self.sel.unregister(child.conn)
        if child.stop_by is None:
            _killpg(pid, signal.SIGTERM)
            child.stop_by = time.monotonic() + STOP_GRACE_S

    def _reap(self) -> None:
        now = time.monotonic()
        for pgid, by in list(self.leftovers.items()):
            if not _group_alive(pgid):
                del self.leftovers[pgid]
            elif now > by:
                _killpg(pgid, signal.SIGKILL)
                del self.leftovers[pgid]
        for pid, child in list(self.children.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 1 << 8
            if done == 0:
                if child.stop_by is not None and now > child.stop_by:
                    _killpg(pid, signal.SIGKILL)
                continue
            # What the server left in its group (its engine core): SIGTERM, then SIGKILL if it outlives the
            # grace. vLLM's engine core answers SIGTERM with a graceful shutdown, which with its server gone
            # can wait forever.
            _killpg(pid, signal.SIGTERM)
            self.leftovers[pid] = now + LEFTOVER_GRACE_S
            rc = os.waitstatus_to_exitcode(status)
            if child.stop_by is None:
                self.sel.unregister(child.conn)
                _send(child.conn, {"exit": rc})
            child.conn.close()
            del self.children[pid]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    buf = b""
    while (got := message(buf)) is None:
        data, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
        if not data:
            raise OSError("the guard closed the connection")
        buf += data
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    request = got[0]
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected stdin, stdout and stderr, got {len(fds)} descriptors")
    if not isinstance(request.get("args"), list) or not isinstance(request.get("env"), dict):
        raise ValueError("args must be a list and env an object")
    return request, list(fds)


def _child(request: dict[str, Any], fds: list[int], server: _Server, conn: socket.socket, parent: int) -> None:
    """In the forked child of ``parent`` (the forkserver): become the engine's server. Never returns."""
    rc = 1
    try:
        # Nothing of the forkserver's stays open here: a guard sees its connection close when the forkserver
        # goes, not when the last server holding a copy of it does.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (before die_with_parent: its signal must end this)
        server.sel.close()
        server.listener.close()
        for end in server.wake:
            end.close()
        conn.close()
        for other in server.children.values():
            other.conn.close()
        os.setpgid(0, 0)  # its own group: the guard and the forkserver stop the server and its engine core
        die_with_parent(parent)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        args = [str(a) for a in request["args"]]
        _retitle([sys.executable, "-m", server.module, *args])
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request.get("cwd") or "/")
        apply_engine_limits()
        _per_engine_fixes()
        sys.argv = [server.module, *args]
        _run_as_main(server.module)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on the engine's own output, then the child exits
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _run_as_main(module: str) -> None:
    """``python -m MODULE`` for a module imported already: its code again, as ``__main__`` (runpy would warn
    that the module is in ``sys.modules``, in every engine's log)."""
    import importlib.util
    import types

    spec = importlib.util.find_spec(module)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {module}")
    code = spec.loader.get_code(module)  # type: ignore[attr-defined]
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=spec.origin, __spec__=spec, __loader__=spec.loader, __package__=spec.parent,
                         __builtins__=__builtins__)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _per_engine_fixes() -> None:
    """The settings of the engine fixes (``_site/sitecustomize.py``) and of torch that the forkserver read at
    its start, read again from the engine's environment."""
    site = sys.modules.get("sitecustomize")
    clamp = getattr(site, "_clamp_affinity", None)
    if clamp is not None:
        clamp()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if threads.isdigit() and torch is not None and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


def _retitle(argv: list[str]) -> None:
    """The child's command line, as ``ps`` and ``/proc`` show it, is the engine's."""
    try:
        import setproctitle

        setproctitle.setproctitle(" ".join(argv))
    except ImportError:
        pass


def main(argv: list[str]) -> int:
    """``python -m pdserve.engine.forkserver SOCKET [MODULE]``: listen at SOCKET at once (a guard that comes
    early waits), import MODULE (vLLM's server), then fork its servers until SIGTERM or SIGINT."""
    if len(argv) not in (1, 2):
        print("usage: python -m pdserve.engine.forkserver SOCKET [MODULE]", file=sys.stderr)
        return 2
    path, module = argv[0], (argv[1] if len(argv) == 2 else SERVER_MODULE)
    die_with_parent()
    server = _Server(_listen(path), module, dict(os.environ))

    def stop(_signum: int, _frame: object) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.monotonic()
    import gc
    import importlib

    try:
        import setproctitle

        # Set up once here, over this process's own command line and environment (a child that replaced
        # its environment could not retitle itself any more).
        setproctitle.setproctitle(setproctitle.getproctitle())
    except ImportError:
        pass

    importlib.import_module(module)
    for also in ALSO_IMPORTED if module == SERVER_MODULE else ():
        try:
            importlib.import_module(also)
        except Exception as e:  # noqa: BLE001 - the engine imports it itself, and reports what fails
            print(f"[pdserve] engine forkserver: {also} not imported ahead ({type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)
    gc.collect()
    gc.freeze()
    print(f"[pdserve] engine forkserver ready in {time.monotonic() - t0:.1f}s: {path}", file=sys.stderr, flush=True)
    try:
        return server.run()
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def _listen(path: str) -> socket.socket:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # only this user may connect: a forked server runs as this user, with its key
    try:
        s.bind(path)
    finally:
        os.umask(old)
    s.listen(16)
    return s


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
