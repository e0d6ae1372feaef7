"""The public port's limits: what one client may hold of the router before it has sent a whole request.

Direct ingress (:mod:`pdserve.router.ingress`) serves the public port with uvicorn, whose HTTP parser
(httptools) reads headers of any size, waits for them and for a body forever, and accepts every
connection: a 64 MiB header was answered 200 and grew the router by 66 MiB, and unfinished headers and a
stalled body stayed open for as long as the client liked. The router needs its memory, its event loop and
its file descriptors for the engines too. :func:`protocol_class` gives uvicorn a protocol with these limits
(``http`` in the config, :class:`~pdserve.config.schema.HttpConfig`):

=======================  ======================================================  =========================
limit                    beyond it                                                default
=======================  ======================================================  =========================
max_header_bytes         431, connection closed                                   32 KiB (request line +
                                                                                  headers)
header_timeout_s         408, connection closed (from a request's first byte,    10 s
                         or the connection's opening, to the end of its headers)
body_timeout_s           408, connection closed (from the end of the headers to  60 s
                         the end of the body)
write_timeout_s          connection closed, the engine's request aborted (an     60 s
                         answer the client has not read for that long: the
                         connection's send buffer full all the while)
max_connections          503 and closed at once (per router replica)              512
max_requests_per_conn    the answer carries ``Connection: close``                 1,000
max_body_bytes           413 (the app's own check, ``router.max_body_bytes``)     (router config)
=======================  ======================================================  =========================

Each refusal is written straight to the socket, without the app: nothing of the request reaches a
handler. Ray Serve's proxy (``http.ingress: proxy``, ``serve run``, KubeRay) has its own settings.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

REASONS = {408: b"Request Timeout", 413: b"Content Too Large", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}


@dataclass(frozen=True)
class EdgeLimits:
    max_header_bytes: int = 32 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 60.0
    max_connections: int = 512
    max_requests_per_connection: int = 1000

    @classmethod
    def from_config(cls, http: Any) -> EdgeLimits:
        return cls(max_header_bytes=http.max_header_bytes, header_timeout_s=http.header_timeout_s,
                   body_timeout_s=http.body_timeout_s, write_timeout_s=http.write_timeout_s,
                   max_connections=http.max_connections,
                   max_requests_per_connection=http.max_requests_per_connection)


@dataclass
class EdgeCounters:
    """What the limits refused (per router replica), by status."""

    refused: dict[int, int]
    #: Connections closed with no answer left to send, by why (``stalled``: a client that read none of its
    #: answer for ``write_timeout_s``).
    closed: dict[str, int] = field(default_factory=dict)

    def count(self, status: int) -> None:
        self.refused[status] = self.refused.get(status, 0) + 1


def refusal(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, with an OpenAI-style error body."""
    import json

    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "server_error", "code": status}}).encode()
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, REASONS.get(status, b"Error"), len(body)))
    return head + body


def protocol_class(limits: EdgeLimits, counters: EdgeCounters | None = None) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with :class:`EdgeLimits` (pass it as ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    counted = counters or EdgeCounters({})

    class EdgeProtocol(HttpToolsProtocol):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0  # the current head's request line and headers, as parsed
            self._raw_head = 0  # bytes received since the current head began (a header still unparsed too)
            self._in_head = True
            self._requests = 0
            self._deadline: asyncio.TimerHandle | None = None
            self._stall: asyncio.TimerHandle | None = None  # while the send buffer is full
            self._refused = False

        # -- the connection ---------------------------------------------------------------------------

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refuse(503, f"the router holds {limits.max_connections} connections already; retry shortly")
                return
            self._arm(limits.header_timeout_s, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._unstall()
            super().connection_lost(exc)

        # -- a client that does not read --------------------------------------------------------------

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall is None:
                self._stall = self.loop.call_later(limits.write_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            self._unstall()
            super().resume_writing()

        def _unstall(self) -> None:
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _stalled(self) -> None:
            """The answer has waited ``write_timeout_s`` on a client that reads none of it: the connection
            goes, as if the client had, so the app ends the answer and its engine request (router/api)."""
            self._stall = None
            if self.transport is None or self.transport.is_closing():
                return
            counted.closed["stalled"] = counted.closed.get("stalled", 0) + 1
            self._end()
            self.transport.abort()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._raw_head += len(data)
            super().data_received(data)
            if not self._refused and self._in_head and self._raw_head > limits.max_header_bytes:
                # Still inside a head that is already too long (its end has not arrived yet).
                self._refuse(431, f"the request's headers are over {limits.max_header_bytes} bytes")

        # -- the parser's callbacks -------------------------------------------------------------------

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            if self._requests:  # the first request's clock started with the connection
                self._arm(limits.header_timeout_s, "headers")

        def on_url(self, url: bytes) -> None:
            self._head_bytes += len(url)
            if self._head_bytes <= limits.max_header_bytes:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_bytes += len(name) + len(value) + 4
            if self._head_bytes <= limits.max_header_bytes:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            if self._head_bytes > limits.max_header_bytes:
                self._refuse(431, f"the request's headers are over {limits.max_header_bytes} bytes")
                return
            self._disarm()
            self._in_head = False
            self._requests += 1
            super().on_headers_complete()
            if self._requests >= limits.max_requests_per_connection and self.cycle is not None:
                self.cycle.keep_alive = False
            if self.parser is not None and self._expects_body():
                self._arm(limits.body_timeout_s, "body")

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            self._in_head, self._raw_head = True, 0
            if not self._refused:
                super().on_message_complete()

        # -- the limits -------------------------------------------------------------------------------

        def _expects_body(self) -> bool:
            for name, value in self.headers or []:
                if name == b"content-length":
                    return value.strip() not in (b"0", b"")
                if name == b"transfer-encoding":
                    return True
            return False

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, seconds, what)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, seconds: float, what: str) -> None:
            self._deadline = None
            if self._refused or self.transport is None or self.transport.is_closing():
                return
            if what == "headers" and self._head_bytes == 0 and self._requests:
                # An idle keep-alive connection between two requests: uvicorn's keep-alive timer owns it.
                return
            cycle = self.cycle
            if what == "body" and cycle is not None and cycle.response_started:
                # The app answered without waiting for the body: just end the connection.
                self._refused = True
                self.transport.close()
                return
            self._refuse(408, f"the request's {what} did not arrive within {seconds:g} s")

        def _end(self) -> None:
            """This connection takes nothing more; the app's request on it, if any, sees the client gone."""
            self._refused = True
            self._disarm()
            if self.cycle is not None:
                self.cycle.disconnected = True
                self.cycle.message_event.set()

        def _refuse(self, status: int, message: str) -> None:
            self._end()
            counted.count(status)
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(refusal(status, message))
                self.transport.close()

    return EdgeProtocol
