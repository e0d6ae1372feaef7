"""The router alone: how many P/D requests per second one core of router sustains, and its CPU per request.

Three processes: minimal fake engines (raw aiohttp, answering instantly) and the load generator share
one core; the router (uvicorn + pdserve's app, static pool) gets the other core to itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

_PREFILL_ANSWER = json.dumps({
    "id": "cmpl-x", "object": "text_completion", "created": 0, "model": "bench", "choices": [
        {"index": 0, "text": "a", "finish_reason": "length"}],
    "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
                           "remote_block_ids": [[1]], "remote_request_id": "x", "remote_host": "127.0.0.1",
                           "remote_port": 1}}).encode()
_DECODE_ANSWER = json.dumps({
    "id": "cmpl-x", "object": "text_completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "text": " a b c d e f g h", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}}).encode()
_STREAM = b"".join(
    b'data: {"id":"cmpl-x","object":"text_completion","model":"bench","choices":[{"index":0,"text":" a"}]}\n\n'
    for _ in range(8)) + b"data: [DONE]\n\n"


async def _engine(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
        return web.Response(body=_PREFILL_ANSWER, content_type="application/json")
    if body.get("stream"):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_STREAM)
        await resp.write_eof()
        return resp
    return web.Response(body=_DECODE_ANSWER, content_type="application/json")


class _FastFake:
    """A minimal HTTP/1.1 keep-alive responder for the fake engines: the router, not the fakes, must be
    the limit of this benchmark, and aiohttp's server costs more per call than the router itself."""

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()

    @staticmethod
    def _reply(body: bytes, ctype: bytes) -> bytes:
        return (b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\n\r\n" + body)

    def run(self, port: int) -> None:
        import asyncio

        prefill = self._reply(_PREFILL_ANSWER, b"application/json")
        decode = self._reply(_DECODE_ANSWER, b"application/json")
        stream = self._reply(_STREAM, b"text/event-stream")
        health = self._reply(b"ok", b"text/plain")

        class Proto(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.t = transport
                self.buf = b""

            def data_received(self, data: bytes) -> None:
                self.buf += data
                while True:
                    end = self.buf.find(b"\r\n\r\n")
                    if end < 0:
                        return
                    head = self.buf[:end].lower()
                    i = head.find(b"content-length:")
                    n = int(head[i + 15:].split(b"\r\n", 1)[0]) if i >= 0 else 0
                    if len(self.buf) < end + 4 + n:
                        return
                    body = self.buf[end + 4:end + 4 + n]
                    self.buf = self.buf[end + 4 + n:]
                    if head.startswith(b"get"):
                        self.t.write(health)
                    elif b'"do_remote_decode": true' in body or b'"do_remote_decode":true' in body:
                        self.t.write(prefill)
                    elif b'"stream": true' in body or b'"stream":true' in body:
                        self.t.write(stream)
                    else:
                        self.t.write(decode)

        self.loop.run_until_complete(self.loop.create_server(Proto, "127.0.0.1", port))
        self.loop.run_forever()


def serve_fakes(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", _engine)
    app.router.add_get("/health", lambda r: web.Response(text="ok"))  # type: ignore[arg-type,return-value]
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_router(port: int, prefill: str, decode: str) -> None:
    import uvicorn

    from pdserve.config.schema import RouterConfig
    from pdserve.router.api import build_app
    from pdserve.router.orchestrator import Orchestrator
    from pdserve.router.pool import EnginePool, Endpoint

    cfg = RouterConfig()
    pool = EnginePool([Endpoint(role="prefill", url=prefill), Endpoint(role="decode", url=decode)])
    app = build_app("bench", pool, Orchestrator(pool, cfg), cfg)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(url: str, seconds: float, concurrency: int, stream: bool) -> tuple[int, int, float]:
    body = {"model": "bench", "prompt": "hello world", "max_tokens": 8, "stream": stream}
    done = errors = 0
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < deadline:
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1
                    else:
                        errors += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done, errors, time.perf_counter() - t0


async def _latency(router_url: str, fake_url: str, n: int) -> dict[str, float]:
    """Added latency at concurrency 1: the bare two calls to the fakes vs one call through the router,
    alternating so drift hits both."""
    from pdserve.bench.stats import percentile
    from pdserve.router.handoff import decode_body, prefill_body

    body = {"model": "bench", "prompt": "hello world", "max_tokens": 8}
    direct, routed = [], []
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if which == 0:
                    async with s.post(fake_url + "/v1/completions", json=prefill_body("completions", body)) as r:
                        kv = (await r.json())["kv_transfer_params"]
                    async with s.post(fake_url + "/v1/completions", json=decode_body(body, kv)) as r:
                        await r.read()
                    direct.append(time.perf_counter() - t0)
                else:
                    async with s.post(router_url + "/v1/completions", json=body) as r:
                        await r.read()
                    routed.append(time.perf_counter() - t0)
    return {"direct_p50_ms": 1000 * percentile(direct, 50), "router_p50_ms": 1000 * percentile(routed, 50),
            "added_p50_ms": 1000 * (percentile(routed, 50) - percentile(direct, 50)),
            "added_p90_ms": 1000 * (percentile(routed, 90) - percentile(direct, 90))}


def _drive_wrk(url: str, seconds: float, concurrency: int, stream: bool) -> tuple[int, int, float] | None:
    """The same load from wrk (C, one thread), when installed: far cheaper per request than a Python
    client, so the router rather than the load generator becomes the limit."""
    import re
    import shutil
    import tempfile

    exe = shutil.which("wrk")
    if exe is None:
        return None
    body = json.dumps({"model": "bench", "prompt": "hello world", "max_tokens": 8, "stream": stream})
    script = ('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
              f"wrk.body = {json.dumps(body)}\n")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    out = subprocess.run([exe, "-t1", f"-c{concurrency}", f"-d{int(seconds)}s", "-s", f.name,
                          url + "/v1/completions"], capture_output=True, text=True, timeout=seconds + 30).stdout
    os.unlink(f.name)
    total = re.search(r"(\d+) requests in ([\d.]+)s", out)
    errs = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if total is None:
        return None
    return int(total.group(1)), int(errs.group(1)) if errs else 0, float(total.group(2))


def _wait(url: str) -> None:
    import urllib.request

    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not start")


def measure_router(seconds: float = 10, concurrency: int = 32) -> dict[str, Any]:
    from pdserve.engine.allocator import free_ephemeral_port, usable_cores

    cores = usable_cores()
    router_core, other = cores[0], cores[-1]
    fport, rport = free_ephemeral_port(), free_ephemeral_port()
    fake_url, router_url = f"http://127.0.0.1:{fport}", f"http://127.0.0.1:{rport}"
    py = sys.executable
    fakes = subprocess.Popen([py, "-m", "pdserve.bench.router_bench", "fakes", str(fport)])
    router = subprocess.Popen([py, "-m", "pdserve.bench.router_bench", "router", str(rport), fake_url, fake_url])
    try:
        os.sched_setaffinity(fakes.pid, {other})
        os.sched_setaffinity(router.pid, {router_core})
        os.sched_setaffinity(0, {other})
        _wait(fake_url)
        _wait(router_url)
        out: dict[str, Any] = {"router_core": router_core, "concurrency": concurrency, "seconds": seconds}
        out["added_latency"] = asyncio.run(_latency(router_url, fake_url, 300))
        for stream in (False, True):
            asyncio.run(_drive(router_url, 1.0, concurrency, stream))  # warm-up
            c0 = _cpu_s(router.pid)
            got = _drive_wrk(router_url, seconds, concurrency, stream)
            client = "wrk"
            if got is None:
                got = asyncio.run(_drive(router_url, seconds, concurrency, stream))
                client = "python"
            done, errors, wall = got
            cpu = _cpu_s(router.pid) - c0
            key = "streaming" if stream else "non_streaming"
            ms = 1000 * cpu / max(done, 1)
            # When the load generator (sharing the other core with the fakes) cannot saturate the router,
            # the router's own CPU per request gives its one-core capacity.
            out[key] = {"client": client, "requests_per_s": done / wall, "errors": errors,
                        "router_cpu_ms_per_request": ms,
                        "router_cpu_utilisation": cpu / wall, "one_core_capacity_rps": 1000 / ms if ms else 0}
        return out
    finally:
        os.sched_setaffinity(0, set(cores))
        for p in (router, fakes):
            p.terminate()
            p.wait(timeout=10)


if __name__ == "__main__":
    if sys.argv[1] == "fakes":
        _FastFake().run(int(sys.argv[2]))
    elif sys.argv[1] == "router":
        serve_router(int(sys.argv[2]), sys.argv[3], sys.argv[4])
