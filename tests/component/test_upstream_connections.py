"""The router's pooled connections to engines: an engine closing a kept-alive connection as the router reuses
it costs the request nothing (the race that failed requests under load when vLLM's 5 s keep-alive ran out)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pdserve.config.schema import RouterConfig
from pdserve.errors import UpstreamError
from pdserve.router.endpoint import Endpoint
from pdserve.router.engine_client import EngineClient, stale_connection


class OneShotServer:
    """Answers the first request on each connection (keeping it alive), then reads the next request on that
    connection and closes without answering, as a server whose idle timeout fires at that moment does."""

    def __init__(self, stream: bool = False) -> None:
        self.stream = stream
        self.connections = 0
        self.answered = 0
        self.dropped = 0
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def __aenter__(self) -> OneShotServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                await reader.readexactly(length)
                if served:
                    self.dropped += 1
                    break
                served += 1
                self.answered += 1
                if self.stream:
                    body = b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'
                    ctype = b"text/event-stream"
                else:
                    body = json.dumps({"choices": [{"text": "hi"}]}).encode()
                    ctype = b"application/json"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: keep-alive\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _client(url: str) -> tuple[EngineClient, Endpoint]:
    ep = Endpoint(role="decode", url=url, engine_id="d0")
    return EngineClient(RouterConfig()), ep


def test_reused_connection_closed_by_the_engine_is_sent_again():
    async def run() -> None:
        async with OneShotServer() as srv:
            orch, ep = _client(srv.url)
            try:
                for i in range(3):
                    status, raw, _ = await orch.post(ep, "completions", {"prompt": "x"}, f"r{i}", 10)
                    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "hi"
            finally:
                await orch.close()
            # Requests 2 and 3 each met a connection the server dropped, and went again on a new one.
            assert (srv.answered, srv.dropped, srv.connections) == (3, 2, 3)
            assert ep.inflight == 0

    asyncio.run(run())


def test_streamed_decode_leg_is_sent_again_too():
    async def run() -> None:
        async with OneShotServer(stream=True) as srv:
            orch, ep = _client(srv.url)
            try:
                for i in range(2):
                    reply = await orch.stream(ep, "completions", {"prompt": "x", "stream": True}, f"r{i}")
                    assert reply.status == 200 and reply.stream is not None
                    chunks = b"".join([c async for c in reply.stream])
                    assert chunks.endswith(b"data: [DONE]\n\n")
            finally:
                await orch.close()
            assert (srv.answered, srv.dropped) == (2, 1)
            assert ep.inflight == 0

    asyncio.run(run())


def test_refused_connection_is_an_upstream_error_not_a_resend():
    async def run() -> None:
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        orch, ep = _client(f"http://127.0.0.1:{port}")
        try:
            with pytest.raises(UpstreamError):
                await orch.post(ep, "completions", {"prompt": "x"}, "r", 5)
            s = await orch.session()
            with pytest.raises(aiohttp.ClientConnectorError) as info:
                await s.get(ep.url)
            assert not stale_connection(info.value)
        finally:
            await orch.close()
        assert ep.inflight == 0

    asyncio.run(run())
