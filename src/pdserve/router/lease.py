"""The KV lease guard: a decode leg never reads prefill blocks that may have been freed before it pulled them.

A prefill engine holds a finished request's KV blocks for a lease (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``) and
frees them when decode has not pulled them by then. Only a handoff slower than ``check_after_s`` can have
outlived the lease; for such a handoff decode's first chunk is held back until the prefill engine, from
vLLM's own record of expired leases, says the lease held. When it did not (or cannot say), the stream is
replaced by a recompute: decode computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp

from pdserve.errors import RequestError
from pdserve.router import sse
from pdserve.router.endpoint import Endpoint
from pdserve.router.engine_client import EngineClient, UpstreamReply
from pdserve.router.http_errors import error_body
from pdserve.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


@dataclass
class Lease:
    """The prefill blocks a decode leg pulls: which engine holds them, under which id, since when."""

    ep: Endpoint
    request_id: str
    since: float


class LeaseGuard:
    def __init__(self, client: EngineClient, metrics: RouterMetrics, check_after_s: float | None,
                 timeout_s: float) -> None:
        self.client = client
        self.metrics = metrics
        # A handoff slower than this (seconds from the prefill answer to decode's first byte) is checked
        # against the prefill engine's KV lease; None turns the check off.
        self.check_after_s = check_after_s
        self.timeout_s = timeout_s

    async def lost(self, lease: Lease | None, request_id: str) -> bool:
        """Whether the prefill blocks this request's decode pulled may have been freed first.

        Only a handoff slower than ``check_after_s`` is checked (a lease cannot run out sooner); the
        prefill engine answers from vLLM's own record of expired leases. No answer counts as lost: the
        price of a needless recompute is one prefill, the price of a wrong guess is wrong tokens."""
        if lease is None or self.check_after_s is None:
            return False
        if time.perf_counter() - lease.since < self.check_after_s:
            return False
        outcome = "unknown"
        try:
            s = await self.client.session()
            async with s.get(f"{lease.ep.url}/pdserve/kv-lease/{quote(lease.request_id, safe='')}",
                             headers=lease.ep.auth(), timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status == 200:
                    ans = await r.json()
                    outcome = "expired" if ans.get("expired") or ans.get("read_after_expiry") else "held"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.warning("request %s: KV lease check on %s failed: %s", request_id, lease.ep.url, e)
        self.metrics.kv_lease.labels(outcome).inc()
        return outcome != "held"

    async def guarded(self, stream: AsyncIterator[bytes], lease: Lease, request_id: str,
                      recompute: Callable[[], Awaitable[UpstreamReply]]) -> AsyncIterator[bytes]:
        """Hold decode's first chunk until the lease is known to have held; else replace the stream."""
        it = stream.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        if not await self.lost(lease, request_id):
            yield first
            async for chunk in it:
                yield chunk
            return
        await stream.aclose()  # type: ignore[attr-defined]
        try:
            again = await recompute()
        except RequestError as e:
            again = UpstreamReply(status=e.status_code, body=json.dumps(
                error_body(e.message, e.error_type, e.status_code)).encode())
        if again.stream is None:
            # Headers are out already: the failure travels in-band, like any mid-stream error.
            try:
                err = json.loads(again.body or b"{}")
            except ValueError:
                err = error_body("decode engine failed", "upstream_error", again.status)
            yield sse.encode(err) + sse.DONE
            return
        async for chunk in again.stream:
            yield chunk
