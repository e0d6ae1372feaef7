"""Soak: steady load on a real pdserve endpoint while engine processes are killed now and then.

    python -m pdserve_bench.soak --minutes 10 --kill-every 90 [--config FILE] [--concurrency 3]

Starts ``pdserve serve`` (or uses ``--url``), sends a mix of streaming and non-streaming requests, and
every ``--kill-every`` seconds SIGKILLs one random engine's vLLM server. Ray Serve's health check
replaces the replica by itself. At the end it prints: sent, succeeded, failed by reason, lost (requests
with neither a complete answer nor an error: must be 0), engine kills and recoveries, and the router
process's memory growth, and the streams that went on on another engine when theirs was killed
(``streams_moved``) against those that ended with an error event (``mid_stream_errors``: must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import urllib.request
from collections import Counter
from typing import Any

import aiohttp

MODEL_FALLBACK = "smollm2-135m-instruct"


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/pdserve/status", timeout=10) as r:
        return dict(json.load(r))


def _server_pid(port: int) -> int | None:
    """The vLLM OpenAI server listening on ``port`` (found through its command line; not its guard)."""
    from pdserve.engine.process import server_pid

    return server_pid(f"http://127.0.0.1:{port}")


async def _one(s: aiohttp.ClientSession, url: str, model: str, i: int, timeout_s: float) -> str:
    """One request; returns 'ok' or a failure reason. 'lost' means no terminal answer at all."""
    stream = i % 2 == 0
    # Streams are longer, so that kills land in the middle of some (they go on elsewhere: router/migrate.py).
    body = {"model": model, "prompt": f"Request {i}: tell me about the number {i}.",
            "max_tokens": 48 if stream else 16, "temperature": 0, "stream": stream}
    try:
        async with s.post(url + "/v1/completions", json=body,
                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            raw = await r.read()
            if r.status != 200:
                return f"http_{r.status}"
            if not stream:
                data = json.loads(raw)
                return "ok" if data.get("choices") else "bad_body"
            text = raw.decode(errors="replace")
            if '"error"' in text:
                return "stream_error_event"
            return "ok" if text.rstrip().endswith("data: [DONE]") else "lost"
    except asyncio.TimeoutError:
        return "lost"
    except aiohttp.ServerDisconnectedError:
        return "lost" if stream else "disconnected"
    except (aiohttp.ClientError, OSError) as e:
        return f"client_{type(e).__name__}"


async def _load(url: str, model: str, stop_at: float, concurrency: int, outcomes: Counter[str],
                timeout_s: float) -> None:
    counter = iter(range(10**9))
    async with aiohttp.ClientSession() as s:
        async def worker() -> None:
            while time.monotonic() < stop_at:
                outcomes["sent"] += 1
                res = await _one(s, url, model, next(counter), timeout_s)
                outcomes[res] += 1
                if res != "ok":
                    await asyncio.sleep(0.5)  # a failing endpoint is not hammered

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _killer(url: str, stop_at: float, every_s: float, log: list[dict[str, Any]]) -> None:
    rng = random.Random(0)
    while True:
        await asyncio.sleep(every_s)
        if time.monotonic() >= stop_at - 30:
            return
        engines = [e for e in _status(url)["engines"] if e["healthy"]]
        if not engines:
            continue
        victim = rng.choice(engines)
        port = int(victim["url"].rsplit(":", 1)[1])
        pid = _server_pid(port)
        if pid is None:
            continue
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        entry = {"t": round(time.monotonic(), 1), "role": victim["role"], "url": victim["url"], "pid": pid}
        log.append(entry)
        print(f"[soak] killed {victim['role']} engine {victim['url']} (pid {pid})", file=sys.stderr, flush=True)
        # Wait for a healthy engine of that role at a new address: the replica came back by itself.
        while time.monotonic() < stop_at:
            await asyncio.sleep(2)
            st = _status(url)["engines"]
            if any(e["role"] == victim["role"] and e["healthy"] and e["url"] != victim["url"] for e in st):
                entry["recovered_s"] = round(time.monotonic() - t0, 1)
                print(f"[soak] {victim['role']} back after {entry['recovered_s']}s", file=sys.stderr, flush=True)
                break


def _migrations(url: str) -> Counter[str]:
    """The router's ``pdserve_stream_migrations_total`` by outcome."""
    out: Counter[str] = Counter()
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pdserve_stream_migrations_total{"):
                out[line.split('"')[1]] += int(float(line.rsplit(" ", 1)[1]))
    return out


def run(url: str, minutes: float, kill_every_s: float, concurrency: int, timeout_s: float) -> dict[str, Any]:
    moved0 = _migrations(url)
    st = _status(url)
    model = st.get("model", MODEL_FALLBACK)
    rss0 = st.get("router", {}).get("rss_bytes", 0)
    outcomes: Counter[str] = Counter()
    kills: list[dict[str, Any]] = []
    stop_at = time.monotonic() + 60 * minutes

    async def main() -> None:
        killer = asyncio.create_task(_killer(url, stop_at, kill_every_s, kills))
        await _load(url, model, stop_at, concurrency, outcomes, timeout_s)
        killer.cancel()

    t0 = time.monotonic()
    asyncio.run(main())
    rss1 = _status(url).get("router", {}).get("rss_bytes", 0)
    sent = outcomes.pop("sent", 0)
    ok = outcomes.pop("ok", 0)
    lost = outcomes.pop("lost", 0)
    moved = _migrations(url)
    moved.subtract(moved0)
    return {
        "minutes": round((time.monotonic() - t0) / 60, 1), "sent": sent, "succeeded": ok,
        "failed_by_reason": dict(outcomes), "lost": lost,
        "mid_stream_errors": outcomes.get("stream_error_event", 0),
        # one router replica answers /metrics: with several, these are that replica's
        "streams_moved": {k: v for k, v in moved.items() if v}, "kills": kills,
        "router_rss_mb": {"start": round(rss0 / 2**20, 1), "end": round(rss1 / 2**20, 1),
                          "growth": round((rss1 - rss0) / 2**20, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve_bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running pdserve endpoint (default: start one)")
    p.add_argument("--config", help="pdserve YAML for the endpoint this starts")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--kill-every", type=float, default=90, help="seconds between engine kills")
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120, help="client timeout per request (s)")
    ns = p.parse_args(argv)
    if ns.url:
        result = run(ns.url.rstrip("/"), ns.minutes, ns.kill_every, ns.concurrency, ns.timeout)
    else:
        from pdserve.config.loader import load_config
        from pdserve_bench.systems import ServedApp

        with ServedApp(load_config(ns.config).args) as app:
            result = run(app.url, ns.minutes, ns.kill_every, ns.concurrency, ns.timeout)
    print(json.dumps(result, indent=2))
    return 0 if result["lost"] == 0 and result["mid_stream_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
