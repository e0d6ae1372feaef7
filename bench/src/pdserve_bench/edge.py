"""The public port under hostile clients: does the router stay responsive?

One app (the config given, default: the embedded one) is started. ``/health`` is timed from one client
(one request every 20 ms, a new connection each, as a load balancer's probe) while the port is idle, then
while ``clients`` hostile connections (200 by default) are held open and renewed for ``seconds``:

- slow heads: a request line and then one header byte every second (slowloris);
- stalled bodies: whole headers announcing a body that never comes;
- oversized heads: a header of 1 MiB, again and again;
- silent connections: opened, nothing sent.

The figure: ``/health`` p50 and p99 under attack minus idle (target: p99 within 100 ms of idle), with
what the edge limits refused (``/pdserve/status`` → ``ingress.refused``) and any health probe that failed.

Then the same probe while ``big_clients`` (4) clients send large text prompts one after another, in turn a
4 MiB one (refused by its length alone) and a 300 KB one (tokenized, in a worker thread, then refused):
the router counts a prompt's tokens before it admits it, and a tokenizer holding the event loop would hold
every other request (a 4 MiB prompt once held ``/health`` 4 s). Its figure: ``/health`` p99 then, minus
idle, and the big prompts' own time to their 400.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve_bench.plan import Plan
from pdserve_bench.stats import percentile
from pdserve_bench.systems import ServedApp, _say

KINDS = ("slow-head", "stalled-body", "oversized-head", "silent")
PROBE_EVERY_S = 0.02


async def _probe(host: str, port: int, until: float) -> tuple[list[float], int]:
    """``/health`` round trips (ms) on new connections until ``until``; and how many failed."""
    times: list[float] = []
    failed = 0
    req = f"GET /health HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode()
    while time.monotonic() < until:
        t0 = time.perf_counter()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
            writer.write(req)
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            if not answer.startswith(b"HTTP/1.1 200"):
                failed += 1
            else:
                times.append((time.perf_counter() - t0) * 1000)
        except (OSError, asyncio.TimeoutError):
            failed += 1
        await asyncio.sleep(PROBE_EVERY_S)
    return times, failed


async def _hostile(kind: str, host: str, port: int, until: float, counts: dict[str, int]) -> None:
    """One hostile client of ``kind``: it reconnects whenever the server closes it, until ``until``."""
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        except (OSError, asyncio.TimeoutError):
            counts["connect_failed"] = counts.get("connect_failed", 0) + 1
            await asyncio.sleep(0.5)
            continue
        counts[kind] = counts.get(kind, 0) + 1
        try:
            if kind == "slow-head":
                writer.write(b"GET /health HTTP/1.1\r\nx-slow: ")
                while time.monotonic() < until and not reader.at_eof():
                    writer.write(b"a")
                    await writer.drain()
                    await asyncio.sleep(1)
            elif kind == "stalled-body":
                writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: 100000\r\n\r\n{\"model\":")
                await writer.drain()
            elif kind == "oversized-head":
                writer.write(b"GET /health HTTP/1.1\r\nx-big: " + b"a" * (1 << 20) + b"\r\n\r\n")
                await writer.drain()
            # wait for the server to answer or close (or the attack to end)
            await asyncio.wait_for(reader.read(), max(0.1, until - time.monotonic()))
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()


async def _attack(host: str, port: int, clients: int, seconds: float) -> dict[str, Any]:
    until = time.monotonic() + seconds
    counts: dict[str, int] = {}
    tasks = [asyncio.create_task(_hostile(KINDS[i % len(KINDS)], host, port, until, counts))
             for i in range(clients)]
    await asyncio.sleep(1)  # the hostile connections are up before the probe starts
    times, failed = await _probe(host, port, until)
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"times_ms": times, "failed": failed, "hostile_connections": counts}


BIG_PROMPTS = {"4 MiB": 4 << 20, "300 KB": 300_000}


async def _big_prompts(host: str, port: int, model: str, clients: int, seconds: float) -> dict[str, Any]:
    """``/health`` timed while ``clients`` send big text prompts in turn; each prompt's time to its answer."""
    until = time.monotonic() + seconds
    answers: dict[str, list[float]] = {k: [] for k in BIG_PROMPTS}
    statuses: dict[str, int] = {}
    bodies = {k: json.dumps({"model": model, "prompt": ("lorem ipsum dolor " * (n // 18 + 1))[:n],
                             "max_tokens": 4}).encode() for k, n in BIG_PROMPTS.items()}

    async def one(i: int) -> None:
        names = list(BIG_PROMPTS)
        k = i
        while time.monotonic() < until:
            name = names[k % len(names)]
            k += 1
            body = bodies[name]
            t0 = time.perf_counter()
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                head = (await asyncio.wait_for(reader.read(), 120))[:12]
                writer.close()
            except (OSError, asyncio.TimeoutError):
                head = b"failed"
            answers[name].append((time.perf_counter() - t0) * 1000)
            code = head.decode(errors="replace").split(" ")[1] if head.startswith(b"HTTP/") else "failed"
            statuses[code] = statuses.get(code, 0) + 1

    senders = [asyncio.create_task(one(i)) for i in range(clients)]
    times, failed = await _probe(host, port, until)
    await asyncio.gather(*senders, return_exceptions=True)
    return {"times_ms": times, "failed": failed, "statuses": statuses,
            "answer_ms": {k: _summary(v, 0) for k, v in answers.items()}}


def _summary(times: list[float], failed: int) -> dict[str, Any]:
    return {"probes": len(times), "failed": failed, "p50_ms": round(percentile(times, 50), 2) if times else None,
            "p99_ms": round(percentile(times, 99), 2) if times else None}


def edge(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    clients = int(opts.get("clients", 200))
    seconds = float(opts.get("seconds", 30))
    big_clients = int(opts.get("big_clients", 4))
    plan.set(clients=clients, seconds=seconds, kinds=list(KINDS), probe_every_s=PROBE_EVERY_S,
             big_clients=big_clients, big_prompts=list(BIG_PROMPTS))
    app = plan.system("pdserve", ServedApp(args))
    plan.phase("idle", system="pdserve", through=f"/health every {PROBE_EVERY_S * 1000:.0f} ms for {seconds:g} s")
    plan.phase("attack", system="pdserve",
               through=f"the same probe while {clients} hostile connections are held ({', '.join(KINDS)})")
    plan.phase("big prompts", system="pdserve",
               through=f"the same probe while {big_clients} clients send {' and '.join(BIG_PROMPTS)} text prompts")
    if plan.dry_run:
        return plan.as_dict()
    with app as served:
        host, port = "127.0.0.1", served.port
        _say(f"idle: /health for {seconds:g} s")
        idle_times, idle_failed = asyncio.run(_probe(host, port, time.monotonic() + seconds))
        _say(f"attack: {clients} hostile clients for {seconds:g} s")
        attacked = asyncio.run(_attack(host, port, clients, seconds))
        with urllib.request.urlopen(served.url + "/pdserve/status", timeout=10) as r:
            ingress = json.load(r).get("ingress", {})
        _say(f"big prompts: {big_clients} clients for {seconds:g} s")
        big = asyncio.run(_big_prompts(host, port, args.model_id, big_clients, seconds))
    idle = _summary(idle_times, idle_failed)
    under = _summary(attacked["times_ms"], attacked["failed"])
    delta = (under["p99_ms"] - idle["p99_ms"]) if under["p99_ms"] is not None and idle["p99_ms"] is not None else None
    during = _summary(big["times_ms"], big["failed"])
    big_delta = (during["p99_ms"] - idle["p99_ms"]) if during["p99_ms"] is not None and idle["p99_ms"] is not None \
        else None
    _say(f"/health p99: idle {idle['p99_ms']} ms, under attack {under['p99_ms']} ms (+{delta} ms); "
         f"refused by the edge: {ingress.get('refused')}")
    _say(f"/health p99 while big prompts are sent: {during['p99_ms']} ms (+{big_delta} ms); their answers "
         f"{big['statuses']}, p50 " + ", ".join(f"{k} {v['p50_ms']} ms" for k, v in big["answer_ms"].items()))
    return {"idle": idle, "attack": under, "p99_delta_ms": delta, "big_prompts": {
                "health": during, "p99_delta_ms": big_delta, "statuses": big["statuses"],
                "answer_ms": big["answer_ms"]},
            "hostile_connections": attacked["hostile_connections"],
            "edge_refused": ingress.get("refused"), "ingress": ingress.get("mode"),
            "limits": args.http.model_dump(include={"max_header_bytes", "header_timeout_s", "body_timeout_s",
                                                    "max_connections", "max_requests_per_connection"})}
