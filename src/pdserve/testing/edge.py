"""The public port's edge on a real socket: a small app behind :class:`DirectIngress` with given limits."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdserve.router.edge import EdgeLimits
from pdserve.router.ingress import DirectIngress
from pdserve.testing.thread_server import free_port


async def _echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"bytes": len(body)})


#: Answers ``/health`` and ``POST /v1/completions`` with the size of the body it read.
ECHO_APP = Starlette(routes=[Route("/health", _echo), Route("/v1/completions", _echo, methods=["POST"])])


def serve_edge(limits: EdgeLimits, scenario: Callable[[int, DirectIngress], Awaitable[Any]],
               app: Any = ECHO_APP) -> None:
    """Run ``scenario(port, ingress)`` against ``app`` behind a direct ingress with ``limits`` on loopback."""
    port = free_port()

    async def main() -> None:
        ingress = DirectIngress(app, "127.0.0.1", port, limits=limits)
        await ingress.start()
        try:
            await scenario(port, ingress)
        finally:
            await ingress.stop()

    asyncio.run(main())
