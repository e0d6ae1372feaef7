"""The load of ``--scenario router``: a closed loop from ``wrk`` (C, one thread) where it is installed, else
from a Python client; and the latency the router adds to the two calls it makes, against the same calls
straight to the fakes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdserve_bench.router_fakes import ENGINE_KEY, client_body


@dataclass
class Drive:
    client: str
    done: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # status (or client error) -> count
    wall_s: float = 0.0

    @property
    def errors(self) -> int:
        return sum(self.failed.values())


async def closed_loop(url: str, seconds: float, concurrency: int, stream: bool) -> Drive:
    out = Drive("python")
    body = client_body(stream)
    stop = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        async def one_client() -> None:
            while time.perf_counter() < stop:
                try:
                    async with s.post(url + "/v1/completions", json=body) as r:
                        await r.read()
                        status = r.status
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    out.failed[type(e).__name__] = out.failed.get(type(e).__name__, 0) + 1
                    continue
                if status == 200:
                    out.done += 1
                else:
                    out.failed[str(status)] = out.failed.get(str(status), 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        out.wall_s = time.perf_counter() - t0
    return out


def _wrk_argv(exe: str, url: str, seconds: float, concurrency: int, script: str) -> list[str]:
    return [exe, "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "-s", script,
            url + "/v1/completions"]


def wrk(exe: str, url: str, seconds: float, concurrency: int, stream: bool) -> Drive | None:
    """The same closed loop from wrk; None when its output cannot be read."""
    lua = ('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
           f"wrk.body = {json.dumps(json.dumps(client_body(stream)))}\n")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "post.lua")
        Path(script).write_text(lua)
        argv = _wrk_argv(exe, url, seconds, concurrency, script)
        return parse_wrk(subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout)


def parse_wrk(out: str) -> Drive | None:
    """Requests answered 2xx, the failures and the wall time from wrk's report."""
    total = re.search(r"(\d+) requests in ([\d.]+)(ms|s|m)\b", out)
    if total is None:
        return None
    failed: dict[str, int] = {}
    if bad := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        failed["non-2xx"] = int(bad.group(1))
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock and sum(map(int, sock.groups())):
        failed["socket"] = sum(map(int, sock.groups()))
    wall = float(total.group(2)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[total.group(3)]
    return Drive("wrk", done=int(total.group(1)) - failed.get("non-2xx", 0), failed=failed, wall_s=wall)


async def added_latency(router: str, fakes: str, pairs: int) -> dict[str, float]:
    """p50/p90 of one request through the router against the bare prefill + decode calls to the fakes."""
    from pdserve.router.handoff import decode_body, prefill_body
    from pdserve_bench.stats import percentile

    body = client_body(False)
    auth = {"Authorization": f"Bearer {ENGINE_KEY}"}
    bare: list[float] = []
    routed: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def two_calls() -> None:
            first = prefill_body("completions", body)
            async with s.post(fakes + "/v1/completions", json=first, headers=auth) as r:
                kv = (await r.json())["kv_transfer_params"]
            async with s.post(fakes + "/v1/completions", json=decode_body(body, kv), headers=auth) as r:
                await r.read()

        async def through_router() -> None:
            async with s.post(router + "/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"the router answered {r.status}: {(await r.text())[:300]}")

        for i in range(pairs):
            order = ((two_calls, bare), (through_router, routed))
            for call, times in (order if i % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                await call()
                times.append(time.perf_counter() - t0)
    b = {p: 1000 * percentile(bare, p) for p in (50, 90)}
    t = {p: 1000 * percentile(routed, p) for p in (50, 90)}
    return {"direct_p50_ms": b[50], "router_p50_ms": t[50], "added_p50_ms": t[50] - b[50],
            "added_p90_ms": t[90] - b[90], "pairs": pairs}
