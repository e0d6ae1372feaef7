"""Direct ingress: router replicas on one public port (SO_REUSEPORT), request ids echoed like Ray's proxy."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
from multidict import CIMultiDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdserve.router.ingress import DirectIngress, reuseport_socket


def _app(name: str) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"replica": name, "path": request.url.path,
                             "request_id": request.headers.get("x-request-id")})

    return Starlette(routes=[Route("/v1/models", echo), Route("/", echo)])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _get(session: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, CIMultiDict[str], str]:
    async with session.get(url, headers=headers) as r:
        return r.status, CIMultiDict(r.headers), await r.text()


def test_two_replicas_share_the_port_and_echo_request_ids() -> None:
    port = _port()

    async def main() -> None:
        a = DirectIngress(_app("a"), "127.0.0.1", port)
        b = DirectIngress(_app("b"), "127.0.0.1", port)
        await a.start()
        await b.start()  # the second bind on the same port succeeds: SO_REUSEPORT
        try:
            seen = set()
            url = f"http://127.0.0.1:{port}/v1/models"
            for _ in range(40):
                # a new connection each time: the kernel spreads connections over the listeners
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                    status, headers, text = await _get(s, url)
                body = json.loads(text)
                seen.add(body["replica"])
                assert status == 200
                # no id sent: one is made, handed to the app, and returned
                assert body["request_id"] and headers["x-request-id"] == body["request_id"]
            assert seen == {"a", "b"}
            async with aiohttp.ClientSession() as s:
                status, headers, text = await _get(s, url, **{"X-Request-Id": "client-42"})
                assert json.loads(text)["request_id"] == "client-42" and headers["x-request-id"] == "client-42"
                # a malformed id reaches the app (which refuses it) and is never echoed back
                status, headers, text = await _get(s, url, **{"X-Request-Id": "bad id;<x>"})
                assert headers["x-request-id"] != "bad id;<x>" and len(headers["x-request-id"]) == 32
        finally:
            await a.stop()
            await b.stop()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as s:
                await _get(s, f"http://127.0.0.1:{port}/v1/models")

    asyncio.run(main())


def test_route_prefix_is_served_and_other_paths_are_404() -> None:
    port = _port()

    async def main() -> None:
        d = DirectIngress(_app("a"), "127.0.0.1", port, route_prefix="/llm/")
        await d.start()
        try:
            async with aiohttp.ClientSession() as s:
                status, _, text = await _get(s, f"http://127.0.0.1:{port}/llm/v1/models")
                assert status == 200 and json.loads(text)["replica"] == "a"
                status, _, _ = await _get(s, f"http://127.0.0.1:{port}/v1/models")
                assert status == 404
                status, _, _ = await _get(s, f"http://127.0.0.1:{port}/llmx/v1/models")
                assert status == 404
        finally:
            await d.stop()

    asyncio.run(main())


def test_a_port_held_without_reuseport_is_a_clear_error() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(OSError):
            reuseport_socket("127.0.0.1", port).close()

        async def main() -> None:
            with pytest.raises(OSError, match="http.ingress: proxy"):
                await DirectIngress(_app("a"), "127.0.0.1", port).start()

        asyncio.run(main())
    finally:
        holder.close()


def test_a_reserved_port_is_taken_for_others_and_open_to_the_router_replicas():
    """`pdserve serve` holds the public port from before Ray starts: a port probe or a bind without
    SO_REUSEPORT (an engine looking for a free port) finds it taken; the router replicas still listen on
    it, and every connection reaches them (the reservation takes none)."""
    from pdserve.engine.allocator import free_ephemeral_port, port_is_free
    from pdserve.router.ingress import reserve_port, reuseport_socket

    port = free_ephemeral_port("127.0.0.1")
    held = reserve_port("127.0.0.1", port)
    try:
        assert not port_is_free(port, "127.0.0.1") and not port_is_free(port)
        with pytest.raises(OSError):
            reserve_port_without_reuse = socket.socket()
            try:
                reserve_port_without_reuse.bind(("127.0.0.1", port))
            finally:
                reserve_port_without_reuse.close()
        listener = reuseport_socket("127.0.0.1", port)
        listener.setblocking(True)
        listener.settimeout(5)
        try:
            for _ in range(20):
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    conn, _ = listener.accept()
                    conn.close()
        finally:
            listener.close()
    finally:
        held.close()
    assert port_is_free(port, "127.0.0.1")


def test_a_second_pdserve_serve_on_a_served_port_is_refused_not_merged(monkeypatch, tmp_path):
    """Two apps of one user could both bind a port with SO_REUSEPORT, and the kernel would split connections
    between them: a second ``pdserve serve`` on a port another one holds stops at once, naming it; once the
    first lets go (or dies: the claim is a lock), the port is anyone's again."""
    import os
    from types import SimpleNamespace

    from pdserve.cli.serve import _hold_port
    from pdserve.engine.allocator import free_ephemeral_port
    from pdserve.errors import PDServeError

    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path))
    port = free_ephemeral_port("127.0.0.1")
    args = SimpleNamespace(http=SimpleNamespace(host="127.0.0.1", port=port))
    first = _hold_port(args)
    try:
        with pytest.raises(PDServeError, match=rf"port {port} is served by another `pdserve serve`.*pid {os.getpid()}"):
            _hold_port(SimpleNamespace(http=SimpleNamespace(host="0.0.0.0", port=port)))
    finally:
        for h in first:
            h.close()
    again = _hold_port(args)
    for h in again:
        h.close()
