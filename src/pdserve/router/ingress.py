"""Direct ingress: a router replica serves the public port itself, without Ray Serve's HTTP proxy in between.

Through Ray Serve, a request crosses the proxy actor (HTTP parsing, a pickled actor call, the answer streamed
back the same way) before the router sees it. On a 2-core host where two engines keep both cores busy, that
hop is most of what a refused request costs, and it sits in every request's time to first token. With direct
ingress each router replica binds the public ``host:port`` with ``SO_REUSEPORT`` (the kernel spreads
connections over the replicas of a node) and serves the same FastAPI app on the replica's own event loop;
Ray Serve's proxy then runs only to serve the app on another port too (``http.proxy_port``). ``pdserve
serve`` turns it on (``http.ingress: direct``, the default); under ``serve run`` and KubeRay, Ray's proxy
owns the port as before.

Ray Serve's proxy returns ``X-Request-Id`` on every answer; :class:`EchoRequestId` does the same here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Iterator
from typing import Any

from pdserve.errors import BadRequest
from pdserve.router import validate
from pdserve.router.edge import EdgeCounters, EdgeLimits, protocol_class

log = logging.getLogger("pdserve.router.ingress")

REQUEST_ID = b"x-request-id"
# Like Ray Serve's proxy (and above the 5 s of uvicorn's default): a client's idle keep-alive connection is
# not closed under it between two requests of a session.
KEEP_ALIVE_S = 90


class EchoRequestId:
    """ASGI wrapper: every request carries an ``X-Request-Id`` (the client's when it is usable, else a new
    one) and every answer returns it, as Ray Serve's proxy does. A malformed one is left for the app to
    refuse (400), and the answer then carries a new id, never the malformed one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers") or [])
        given = next((v for k, v in headers if k == REQUEST_ID), None)
        try:
            rid = validate.request_id(given.decode("latin-1") if given is not None else None)
        except BadRequest:
            rid = None
            echo = uuid.uuid4().hex
        else:
            if rid is None:
                rid = uuid.uuid4().hex
                headers.append((REQUEST_ID, rid.encode()))
                scope = {**scope, "headers": headers}
            echo = rid

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                out = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID]
                message = {**message, "headers": [*out, (REQUEST_ID, echo.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class UnderPrefix:
    """ASGI wrapper serving ``app`` under Ray Serve's ``route_prefix`` (``/`` serves everything)."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app = app
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self.prefix or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path != self.prefix and not path.startswith(self.prefix + "/"):
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
            await send({"type": "http.response.body", "body": f"Path '{path}' not found.".encode()})
            return
        rest = path[len(self.prefix):] or "/"
        await self.app({**scope, "path": rest, "root_path": scope.get("root_path", "") + self.prefix},
                       receive, send)


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that other replicas on this host may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, not listening, socket on ``host:port`` with ``SO_REUSEPORT`` only: while it is open, processes
    looking for a free port (engines, Ray, NIXL, anything binding port 0 or probing) find this one taken,
    and the router replicas (same user, ``SO_REUSEPORT``) can still bind and listen on it. It takes no
    connections: the kernel hands those to listening sockets only."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class DirectIngress:
    """Serves ``app`` on ``host:port`` from the running event loop (the replica's, where the app's state
    lives) until :meth:`stop`."""

    def __init__(self, app: Any, host: str, port: int, route_prefix: str = "/",
                 limits: EdgeLimits | None = None) -> None:
        self.app = EchoRequestId(UnderPrefix(app, route_prefix))
        self.host, self.port = host, port
        self.limits = limits or EdgeLimits()
        #: What the edge limits refused, by status (shown in /pdserve/status).
        self.counters = EdgeCounters({})
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import uvicorn

        from pdserve.idle import uvicorn_main_loop

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                # The replica's process belongs to Ray: its signals are not this server's to take.
                yield

            # One tick a second instead of ten (the Date header is refreshed once a second either way).
            main_loop = uvicorn_main_loop

        try:
            sock = reuseport_socket(self.host, self.port)
        except OSError as e:
            raise OSError(e.errno, f"direct ingress cannot listen on {self.host}:{self.port}: {e.strerror} "
                                   "(another process holds the port without SO_REUSEPORT; set "
                                   "http.ingress: proxy or another http.port)") from e
        config = uvicorn.Config(self.app, lifespan="off", log_level="warning", access_log=False,
                                timeout_keep_alive=KEEP_ALIVE_S, server_header=False,
                                http=protocol_class(self.limits, self.counters))
        self._server = Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what stopped it
            raise RuntimeError(f"direct ingress on {self.host}:{self.port} stopped at start")
        log.info("router serves %s:%d directly (SO_REUSEPORT)", self.host, self.port)

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, timeout=10)
