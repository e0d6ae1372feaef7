"""What every route of the HTTP API shares: the request's id, caller and body, the app's parts, the stream
that gives its request's claims back."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from pdserve.config.schema import RouterConfig
from pdserve.errors import EngineAnswer, PayloadTooLarge, RequestError, ShuttingDown
from pdserve.router import validate
from pdserve.router.auth import ANONYMOUS, Caller
from pdserve.router.body import parse_body_off_loop
from pdserve.router.engine_client import UpstreamReply
from pdserve.router.flight import Flight
from pdserve.router.http_errors import to_response
from pdserve.router.metrics import RouterMetrics
from pdserve.router.models import ServedModels
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.pool import EnginePool

REQUEST_ID_HEADER = validate.REQUEST_ID_HEADER


@dataclass
class Api:
    """The parts the routes use."""

    model_id: str
    pool: EnginePool
    orchestrator: Orchestrator
    cfg: RouterConfig
    served: ServedModels
    metrics: RouterMetrics
    #: False when a proxy in front (Ray Serve's) already echoes ``X-Request-Id``.
    echo_request_id: bool = True

    def failed(self, e: BaseException, request_id: str | None = None) -> Response:
        """The error's answer (through :mod:`pdserve.router.http_errors`), counted by its type."""
        if self.orchestrator.closing and isinstance(e, RuntimeError):
            # aiohttp's "Session is closed": the connection pool closed under a request in flight.
            e = ShuttingDown()
        self.metrics.errors.labels(f"engine_{e.status}" if isinstance(e, EngineAnswer) else type(e).__name__).inc()
        return to_response(e, request_id if self.echo_request_id else None)

    def reply(self, reply: UpstreamReply, request_id: str) -> Response:
        headers = {REQUEST_ID_HEADER: request_id} if self.echo_request_id else {}
        if reply.stream is not None:
            headers["Cache-Control"] = "no-cache"
            headers["X-Accel-Buffering"] = "no"
            return OwnedStream(reply.stream, reply.flight, status_code=reply.status,
                               media_type="text/event-stream", headers=headers)
        return Response(reply.body or b"", status_code=reply.status, media_type=reply.content_type or None,
                        headers=headers)


class OwnedStream(StreamingResponse):
    """A streamed answer that gives its request's claims back when the response is over, however it
    ends: sent in full, the client gone before the first byte, or the task cancelled."""

    def __init__(self, content: Any, flight: Flight | None, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.flight = flight

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.flight is not None:
                self.flight.release()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def request_id(request: Request) -> str:
    """The client's request id, or a new one when it sent none (:class:`BadRequest` for one that cannot be
    used: it goes into engine request ids, headers and log lines)."""
    return validate.request_id(request.headers.get(REQUEST_ID_HEADER)) or uuid.uuid4().hex


def engine_request_id(request: Request, rid: str) -> str:
    """The id the engines know a request by: ``rid`` when the router made it, else the client's with a suffix of
    the router's. Engines keep things under it -- a finished turn's KV blocks for the next one
    (engine/kv_handback.py), a Responses answer vLLM stores -- so one client's id must never name another's
    request there: two clients (or tenants) sending the same ``X-Request-Id`` get engine ids of their own. The
    client still reads its own id in the response's header and in the router's log lines."""
    return f"{rid}-{uuid.uuid4().hex[:8]}" if request.headers.get(REQUEST_ID_HEADER) else rid


def caller(request: Request) -> Caller:
    """Who sent the request, as :meth:`ApiKeys.check` named it (:data:`ANONYMOUS` when the app has no keys)."""
    return getattr(request.state, "caller", None) or ANONYMOUS


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request's body as a JSON object, read up to ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"request body is {length} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return await parse_body_off_loop(b"".join(chunks))


__all__ = ["Api", "OwnedStream", "REQUEST_ID_HEADER", "RequestError", "caller", "read_json", "request_id"]
