"""``--scenario router``: the router alone. How many P/D requests per second one core of router carries,
its CPU time per request, and the latency it adds to the two calls it makes.

Three processes. The router (uvicorn + pdserve's app, a static pool of one prefill and one decode
endpoint, built the way the router deployment builds it: request checks, admission by work, engine keys)
is pinned to one core. Minimal fake engines and the load generator share another core: the fakes are a
bare asyncio HTTP/1.1 keep-alive responder with canned answers, because aiohttp's or FastAPI's server
costs more per call than the router does and would be the limit instead. The load comes from ``wrk``
when it is installed (C, one thread), else from a Python client.

Per mode (non-streaming, streaming with 8 chunks): 1 s of warm-up, then ``seconds`` of closed-loop load
at ``concurrency``. Before that, the added latency: at concurrency 1, one request through the router
against the same two calls made straight to the fakes, alternating which goes first so drift hits both.

Options (``--opt``): ``seconds`` (10), ``concurrency`` (32), ``latency_requests`` (300 pairs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

MODEL = "bench"
PROMPT = "hello world"
MAX_TOKENS = 8
STREAM_CHUNKS = 8
#: The key the fakes ask for, as every real engine asks for its own (the router sends it on both legs).
ENGINE_KEY = "bench-engine-key"
#: The fakes answer at once; admission by work has its own tests (tests/unit/test_admission.py).
CALIBRATED_RATE = 1e6
WARMUP_S = 1.0
START_TIMEOUT_S = 180.0  # the router imports vLLM's request models at start: seconds on a busy host


def client_body(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}


# --- the fake engines ---------------------------------------------------------------------------------


def _http(body: bytes, ctype: bytes, status: bytes = b"200 OK") -> bytes:
    head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (status, ctype, len(body))
    return head + body


def _canned() -> dict[str, bytes]:
    """Whole HTTP responses: the prefill leg's answer (KV params decode can pull with), decode's answer,
    decode's stream, health, and the refusal of a request without the engine key."""
    prefill = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
               "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
               "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                      "remote_engine_id": "bench-prefill", "remote_block_ids": [[1]],
                                      "remote_request_id": "bench", "remote_host": "127.0.0.1",
                                      "remote_port": 1}}
    decode = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
              "choices": [{"index": 0, "text": " a" * MAX_TOKENS, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 2, "completion_tokens": MAX_TOKENS, "total_tokens": 2 + MAX_TOKENS}}
    chunk = b"data: %s\n\n" % json.dumps({"id": "cmpl-bench", "object": "text_completion", "model": MODEL,
                                           "choices": [{"index": 0, "text": " a"}]}).encode()
    stream = chunk * STREAM_CHUNKS + b"data: [DONE]\n\n"
    refused = {"error": {"message": "missing or wrong engine key", "type": "Unauthorized", "code": 401}}
    return {"prefill": _http(json.dumps(prefill).encode(), b"application/json"),
            "decode": _http(json.dumps(decode).encode(), b"application/json"),
            "stream": _http(stream, b"text/event-stream"),
            "health": _http(b"ok", b"text/plain"),
            "refused": _http(json.dumps(refused).encode(), b"application/json", b"401 Unauthorized")}


def _answer(head: bytes, body: bytes, canned: dict[str, bytes], auth: bytes) -> bytes:
    """The canned response for one request (``head`` lowercased): GETs are health checks; a POST must carry
    the key, and is a prefill leg when it asks the engine to keep its blocks for a remote decode."""
    if head.startswith(b"get"):
        return canned["health"]
    if auth not in head:
        return canned["refused"]
    compact = body.replace(b" ", b"")
    if b'"do_remote_decode":true' in compact:
        return canned["prefill"]
    return canned["stream"] if b'"stream":true' in compact else canned["decode"]


def serve_fakes(port: int, key: str = ENGINE_KEY) -> None:
    """Both fake engines on one port (the router's pool holds it once per role), until killed."""
    canned = _canned()
    auth = b"authorization: bearer " + key.lower().encode()

    class Conn(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.pending = b""

        def data_received(self, data: bytes) -> None:
            self.pending += data
            while (end := self.pending.find(b"\r\n\r\n")) >= 0:
                head = self.pending[:end].lower()
                m = re.search(rb"\r\ncontent-length:\s*(\d+)", head)
                size = int(m.group(1)) if m else 0
                if len(self.pending) < end + 4 + size:
                    return  # the body is still on its way
                body = self.pending[end + 4:end + 4 + size]
                self.pending = self.pending[end + 4 + size:]
                self.transport.write(_answer(head, body, canned, auth))

    loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_server(Conn, "127.0.0.1", port))
    loop.run_forever()


# --- the router ---------------------------------------------------------------------------------------


def router_app(prefill: str, decode: str, *, key: str = ENGINE_KEY, tokenizer: str | None = None) -> Any:
    """The router's app as the router deployment builds it (pdserve/app/deployments.py) for the default
    config, with a static pool of two calibrated endpoints instead of the registry."""
    from pdserve.config.kv_transfer import prefill_kv_lease_s
    from pdserve.config.schema import PDServeArgs
    from pdserve.engine.launcher import engine_kwargs_for
    from pdserve.router.build import build_router
    from pdserve.router.pool import Endpoint
    from pdserve.router.prompt_length import PromptLength
    from pdserve.router.validate import EngineLimits

    args = PDServeArgs()
    r = args.router
    eps = [Endpoint(role="prefill", url=prefill, engine_id="bench-prefill", api_key=key),
           Endpoint(role="decode", url=decode, engine_id="bench-decode", api_key=key)]
    for ep in eps:
        ep.load.calibrated(CALIBRATED_RATE)
    lease_s = prefill_kv_lease_s(args.prefill_config.engine_kwargs.get("kv_transfer_config"), args.nixl)
    roles = ("prefill", "decode")
    kwargs = [engine_kwargs_for(role, args, on_cpu=True) for role in roles]  # type: ignore[arg-type]
    router = build_router(r, MODEL, endpoints=eps, lengths=PromptLength(tokenizer), lease_s=lease_s,
                          limits=EngineLimits.from_engine_kwargs(*kwargs),
                          lease_check_after_s=0.5 * lease_s if r.kv_lease_check else None)
    app, orch = router.app, router.orchestrator
    app.state.bench_checks = orch.validator.summary()  # after build_app: it loads vLLM's request models
    return app


def serve_router(port: int, prefill: str, decode: str, *, tokenizer: str | None, facts: str | None) -> None:
    import uvicorn

    app = router_app(prefill, decode, tokenizer=tokenizer)
    if facts:
        Path(facts).write_text(json.dumps(app.state.bench_checks))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- load ---------------------------------------------------------------------------------------------


@dataclass
class Drive:
    client: str
    done: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # status (or client error) -> count
    wall_s: float = 0.0

    @property
    def errors(self) -> int:
        return sum(self.failed.values())


async def _closed_loop(url: str, seconds: float, concurrency: int, stream: bool) -> Drive:
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


def _wrk(exe: str, url: str, seconds: float, concurrency: int, stream: bool) -> Drive | None:
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


async def _added_latency(router: str, fakes: str, pairs: int) -> dict[str, float]:
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


# --- the measurement ----------------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_up(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {what} exited with {proc.returncode} before answering /health")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the {what} at {url} did not answer /health within {timeout_s:.0f}s")


@dataclass
class Setup:
    """Everything :func:`measure_router` starts and runs, decided before anything starts."""

    seconds: float
    concurrency: int
    latency_pairs: int
    router_core: int
    other_core: int
    fake_port: int
    router_port: int
    tokenizer: str | None
    wrk: str | None

    @classmethod
    def make(cls, seconds: float, concurrency: int, latency_pairs: int) -> Setup:
        from pdserve.engine.allocator import free_ephemeral_port, usable_cores
        from pdserve.model.embedded import embedded_model_dir, is_prepared

        cores = usable_cores()
        # The router counts prompts with the model's tokenizer where it has one, as deployed (never
        # prepared here).
        tok = embedded_model_dir()
        return cls(seconds, concurrency, latency_pairs, router_core=cores[0], other_core=cores[-1],
                   fake_port=free_ephemeral_port(), router_port=free_ephemeral_port(),
                   tokenizer=str(tok) if is_prepared(tok) else None, wrk=shutil.which("wrk"))

    @property
    def fake_url(self) -> str:
        return f"http://127.0.0.1:{self.fake_port}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def fakes_argv(self) -> list[str]:
        return [sys.executable, "-m", "pdserve_bench.router_bench", "fakes", str(self.fake_port)]

    def router_argv(self, facts: str | None = None) -> list[str]:
        argv = [sys.executable, "-m", "pdserve_bench.router_bench", "router", str(self.router_port),
                self.fake_url, self.fake_url]
        if self.tokenizer:
            argv += ["--tokenizer", self.tokenizer]
        if facts:
            argv += ["--facts", facts]
        return argv

    def record(self, plan: Any) -> None:
        client = "wrk" if self.wrk else "python"
        plan.set(seconds=self.seconds, concurrency=self.concurrency, latency_requests=self.latency_pairs,
                 client=client, shared_core=self.router_core == self.other_core)
        plan.require("uvicorn", "fastapi", "vllm", executables=("wrk",))
        plan.workload("completion", body=client_body(False), stream_chunks=STREAM_CHUNKS)
        plan.system("fake engines", {"kind": "process", "argv": self.fakes_argv(), "core": self.other_core,
                                     "roles": ["prefill", "decode"], "engine_key": "required"})
        plan.system("router", {"kind": "process", "argv": self.router_argv(), "core": self.router_core,
                               "config": "the default router config, static pool, calibrated endpoints",
                               "prompt_lengths": "tokenizer" if self.tokenizer else "estimate"})
        plan.phase("added latency", system="router", load="concurrency:1", workload="completion",
                   pairs=self.latency_pairs, against="the same two calls straight to the fakes")
        for mode in ("non_streaming", "streaming"):
            plan.phase(mode, system="router", load=f"concurrency:{self.concurrency}", workload="completion",
                       client=client, warmup_s=WARMUP_S, seconds=self.seconds, client_core=self.other_core)


def measure_router(seconds: float = 10, concurrency: int = 32, *, latency_requests: int = 300,
                   plan: Any = None) -> dict[str, Any]:
    """The figures of ``--scenario router``. With a dry-run ``plan``, returns it without starting
    anything."""
    setup = Setup.make(seconds, concurrency, latency_requests)
    if plan is not None:
        setup.record(plan)
        if plan.dry_run:
            return dict(plan.as_dict())
    from pdserve_bench.overload_long import host_cpu

    before = os.sched_getaffinity(0)
    facts = tempfile.NamedTemporaryFile(prefix="pdserve-router-bench-", suffix=".json", delete=False)
    facts.close()
    fakes = subprocess.Popen(setup.fakes_argv())
    router = subprocess.Popen(setup.router_argv(facts.name))
    try:
        os.sched_setaffinity(fakes.pid, {setup.other_core})
        os.sched_setaffinity(router.pid, {setup.router_core})
        os.sched_setaffinity(0, {setup.other_core})  # this thread drives the load
        _wait_up(setup.fake_url, fakes, "fake engines")
        _wait_up(setup.router_url, router, "router")
        out: dict[str, Any] = {"host_cpu": host_cpu(), "router_core": setup.router_core,
                               "shared_core": setup.router_core == setup.other_core,
                               "concurrency": concurrency, "seconds": seconds,
                               "request_checks": json.loads(Path(facts.name).read_text() or "{}"),
                               "prompt_lengths": "tokenizer" if setup.tokenizer else "estimate"}
        out["added_latency"] = asyncio.run(_added_latency(setup.router_url, setup.fake_url, latency_requests))
        for stream in (False, True):
            asyncio.run(_closed_loop(setup.router_url, WARMUP_S, concurrency, stream))
            c0 = _cpu_s(router.pid)
            got = _wrk(setup.wrk, setup.router_url, seconds, concurrency, stream) if setup.wrk else None
            if got is None:
                got = asyncio.run(_closed_loop(setup.router_url, seconds, concurrency, stream))
            cpu = _cpu_s(router.pid) - c0
            ms = 1000 * cpu / got.done if got.done else 0.0
            # When the load generator (sharing its core with the fakes) cannot saturate the router, the
            # router's CPU per request still gives what its one core would carry.
            out["streaming" if stream else "non_streaming"] = {
                "client": got.client, "requests_per_s": got.done / got.wall_s if got.wall_s else 0.0,
                "errors": got.errors, "failed": got.failed, "router_cpu_ms_per_request": ms,
                "router_cpu_utilisation": cpu / got.wall_s if got.wall_s else 0.0,
                "one_core_capacity_rps": 1000 / ms if ms else 0.0}
        return out
    finally:
        os.sched_setaffinity(0, before)
        for p in (router, fakes):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        os.unlink(facts.name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve_bench.router_bench",
                                description="the processes of --scenario router")
    sub = p.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fakes")
    f.add_argument("port", type=int)
    r = sub.add_parser("router")
    r.add_argument("port", type=int)
    r.add_argument("prefill")
    r.add_argument("decode")
    r.add_argument("--tokenizer")
    r.add_argument("--facts", help="write the router's request checks here once it is built")
    ns = p.parse_args(argv)
    if ns.what == "fakes":
        serve_fakes(ns.port)
    else:
        serve_router(ns.port, ns.prefill, ns.decode, tokenizer=ns.tokenizer, facts=ns.facts)


if __name__ == "__main__":
    main()
