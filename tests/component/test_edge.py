"""The public port's limits (router/edge.py) on a real socket: oversized heads, stalled heads and bodies,
too many connections, requests per connection; the server answers its other clients meanwhile."""

from __future__ import annotations

import asyncio

from pdserve.router.edge import EdgeLimits
from pdserve.router.ingress import DirectIngress
from pdserve.testing.edge import serve_edge


async def _exchange(port: int, data: bytes, *, then_wait: bool = True) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it (or 5 s pass)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5) if then_wait else b""
    finally:
        writer.close()


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


async def _health(port: int) -> int:
    return _status(await _exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"))


def test_a_head_over_the_limit_gets_431_and_nothing_reaches_the_app():
    async def scenario(port: int, ingress: DirectIngress) -> None:
        big = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n"
        answer = await _exchange(port, big)
        assert _status(answer) == 431 and b"over 4096 bytes" in answer
        # A head that never ends but keeps growing is cut as soon as it passes the limit.
        endless = b"GET /health HTTP/1.1\r\nx-big: " + b"a" * 50_000
        assert _status(await _exchange(port, endless)) == 431
        assert ingress.counters.refused[431] == 2
        assert await _health(port) == 200

    serve_edge(EdgeLimits(max_header_bytes=4096), scenario)


def test_stalled_heads_and_bodies_get_408_while_others_are_answered():
    async def scenario(port: int, ingress: DirectIngress) -> None:
        head_only = asyncio.create_task(_exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n"))
        silent = asyncio.create_task(_exchange(port, b""))
        body = asyncio.create_task(_exchange(
            port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"a\":"))
        assert await _health(port) == 200  # answered while the three hold their connections
        answers = await asyncio.gather(head_only, silent, body)
        assert [_status(a) for a in answers] == [408, 408, 408]
        assert b"headers did not arrive" in answers[0] and b"body did not arrive" in answers[2]
        # a whole request with a body is answered
        ok = await _exchange(port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
                                   b"connection: close\r\n\r\n{}")
        assert _status(ok) == 200 and b'"bytes":2' in ok

    serve_edge(EdgeLimits(header_timeout_s=0.3, body_timeout_s=0.3), scenario)


def test_connections_over_the_limit_get_503_at_once():
    async def scenario(port: int, ingress: DirectIngress) -> None:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await asyncio.sleep(0.05)
        answer = await _exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _status(answer) == 503 and b"holds 3 connections" in answer
        for _, w in held:
            w.close()
        await asyncio.sleep(0.05)
        assert await _health(port) == 200

    serve_edge(EdgeLimits(max_connections=3), scenario)


def test_a_connection_carries_at_most_so_many_requests():
    async def scenario(port: int, ingress: DirectIngress) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for _ in range(2):
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            answers.append(head.lower())
        assert b"connection: close" not in answers[0] and b"connection: close" in answers[1]
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        writer.close()

    serve_edge(EdgeLimits(max_requests_per_connection=2), scenario)


def test_a_client_that_reads_none_of_a_long_stream_is_closed_and_its_engine_request_ends():
    """A client that opens a long stream and never reads: once the answer has waited ``write_timeout_s`` on
    the full send buffer the connection goes, the engine's request with it, and its decode slot is free."""
    import json
    import socket

    from pdserve.config.schema import RouterConfig
    from pdserve.router.build import build_router
    from tests.component.test_router import MODEL, System

    system = System()
    for e in system.prefill + system.decode:
        e.max_model_len = 200_000
    with system as s:
        cfg = RouterConfig(policy="round_robin", prefill_timeout_s=5, decode_timeout_s=600, local_prefill_below_tokens=0)
        app = build_router(cfg, MODEL, endpoints=s.pool.endpoints()).app
        decode = next(ep for ep in s.pool.endpoints() if ep.role == "decode")

        async def scenario(port: int, ingress: DirectIngress) -> None:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            body = json.dumps({"model": MODEL, "prompt": "tell me a story", "max_tokens": 150_000,
                               "stream": True, "temperature": 0}).encode()
            sock.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
            try:
                for _ in range(600):  # (a bound, not a timing: the test fails rather than hangs)
                    if ingress.counters.closed.get("stalled") and decode.inflight == 0:
                        break
                    await asyncio.sleep(0.1)
                assert ingress.counters.closed.get("stalled") == 1 and decode.inflight == 0, \
                    (ingress.counters, decode.inflight)
                assert await _health(port) == 200
            finally:
                sock.close()

        serve_edge(EdgeLimits(write_timeout_s=1.0), scenario, app=app)
