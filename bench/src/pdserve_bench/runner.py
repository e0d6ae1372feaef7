"""Drive a workload against an OpenAI-compatible endpoint: fixed concurrency, constant or Poisson rate."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from pdserve_bench.client import Result, stream_completion
from pdserve_bench.workload import BenchRequest, request_body


@dataclass(frozen=True)
class Load:
    """``concurrency:N``, ``rate:R`` (constant, req/s) or ``poisson:R``."""

    kind: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Load:
        from pdserve.errors import ConfigError

        try:
            kind, v = text.split(":")
            if kind in ("concurrency", "rate", "poisson") and float(v) > 0:
                return cls(kind, float(v))
        except ValueError:
            pass
        raise ConfigError(f"bad load {text!r}: use concurrency:N, rate:R or poisson:R")

    def label(self) -> str:
        return f"{self.kind}:{self.value:g}"


async def run_load(
    base_url: str | list[str], model: str, requests: list[BenchRequest], load: Load, *, seed: int = 0,
    progress: bool = True, timeout_s: float = 600, prefill_url: str | None = None,
    auth: Callable[[str], dict[str, str]] | None = None, retry_refused: bool = False,
) -> tuple[list[Result], float]:
    """Send ``requests`` under ``load``. With ``prefill_url``, each request is the bare two-call handoff
    (prefill engine, then ``base_url`` as the decode engine). Several ``base_url`` are used in turn
    (client-side round-robin over independent engines: the colocated baseline). ``retry_refused``: a 429
    is sent again after its ``retry-after-ms`` (as OpenAI's clients do) while ``timeout_s`` allows; the
    result's times count from the first attempt."""
    bases = [u.rstrip("/") for u in ([base_url] if isinstance(base_url, str) else base_url)]
    urls = [u + "/v1/completions" for u in bases]
    turn = 0
    purl = prefill_url.rstrip("/") + "/v1/completions" if prefill_url else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=f"bench {load.label()}", unit="req", file=sys.stderr, leave=False)
    results: list[Result] = []
    if not requests:
        return results, 0.0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async def one(req: BenchRequest) -> None:
            nonlocal turn
            url, base = urls[turn % len(urls)], bases[turn % len(urls)]
            turn += 1
            first = time.perf_counter()
            retries = 0
            while True:
                r = await stream_completion(s, url, request_body(model, req), len(req.prompt_ids),
                                            prefill_url=purl, auth=auth)
                waited = r.start_s - first
                if not (retry_refused and r.status == 429
                        and waited + r.e2e_s + r.retry_wait_s < timeout_s):
                    break
                retries += 1
                await asyncio.sleep(r.retry_wait_s)
            r.target = base
            if retries:
                r.retries, r.start_s = retries, first
                r.e2e_s += waited
                if r.ttft_s:
                    r.ttft_s += waited
            results.append(r)
            if bar is not None:
                bar.update(1)

        t0 = time.perf_counter()
        if load.kind == "concurrency":
            queue = list(requests)

            async def worker() -> None:
                while queue:
                    await one(queue.pop(0))

            await asyncio.gather(*(worker() for _ in range(int(load.value))))
        else:
            rng = random.Random(seed)
            tasks = []
            next_t = t0
            for req in requests:
                delay = next_t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
                gap = 1.0 / load.value
                next_t += rng.expovariate(load.value) if load.kind == "poisson" else gap
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return results, wall
