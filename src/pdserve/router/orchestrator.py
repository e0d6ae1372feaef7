"""Runs one client request through the prefill and decode legs.

The router talks to the engines' own OpenAI servers over plain HTTP (aiohttp, pooled keep-alive
connections): the data path is the same two calls a hand-written handoff client makes, with nothing in
between. Streaming bytes from the decode engine are passed to the client as they arrive, unparsed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.config.schema import RouterConfig
from pdserve.errors import NoEngineAvailable, Overloaded, RequestError, UpstreamError, UpstreamTimeout
from pdserve.router import handoff
from pdserve.router.handoff import Route
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Endpoint, EnginePool
from pdserve.router.prompt_length import PromptLength

log = logging.getLogger(__name__)

PATHS: dict[Route, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class UpstreamReply:
    """What the router hands back: a finished body or a byte stream, with status and headers."""

    status: int
    body: bytes | None = None
    stream: AsyncIterator[bytes] | None = None
    content_type: str = "application/json"


@dataclass
class Lease:
    """The prefill blocks a decode leg pulls: which engine holds them, under which id, since when."""

    ep: Endpoint
    request_id: str
    since: float


class EngineAnswer(Exception):
    """An engine answered with an error status; its body is passed to the client unchanged."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


class Orchestrator:
    def __init__(self, pool: EnginePool, cfg: RouterConfig, metrics: RouterMetrics | None = None,
                 lengths: PromptLength | None = None, lease_check_after_s: float | None = None) -> None:
        self.pool = pool
        self.cfg = cfg
        # A handoff slower than this (seconds from the prefill answer to decode's first byte) is checked
        # against the prefill engine's KV lease; None turns the check off.
        self.lease_check_after_s = lease_check_after_s
        self.lengths = lengths or PromptLength()
        self.metrics = metrics or RouterMetrics()
        self._session: aiohttp.ClientSession | None = None
        # Requests admitted and not finished, per role (a request holds its prefill slot until its
        # prefill leg ends, its decode slot until the answer is complete).
        self.admitted: dict[str, int] = {"prefill": 0, "decode": 0}
        self.stats: dict[str, int] = {"pd": 0, "local": 0, "prefill_fallback": 0, "no_kv_params": 0}

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def check(self, ep: Endpoint) -> bool:
        try:
            s = await self.session()
            async with s.get(ep.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    # -- the flow -------------------------------------------------------------------------------

    def _admit(self) -> None:
        """The router's and each role's in-flight bounds, checked before anything is sent, so a refused
        request holds no KV blocks. Every admitted request holds a decode slot until its answer ends."""
        if self.admitted["decode"] >= self.cfg.max_inflight:
            self.metrics.errors.labels("Overloaded").inc()
            raise Overloaded(f"the router holds {self.cfg.max_inflight} requests; retry shortly")
        for role, per in (("decode", self.cfg.max_inflight_per_decode_engine),
                          ("prefill", self.cfg.max_inflight_per_prefill_engine)):
            healthy = self.pool.healthy(role)  # type: ignore[arg-type]
            if healthy and self.admitted[role] >= per * len(healthy):
                self.metrics.errors.labels(f"{role}_full").inc()
                raise Overloaded(f"all {role} engines are at their in-flight limit ({per} each); retry shortly")
        self.admitted["prefill"] += 1
        self.admitted["decode"] += 1

    def routing_key(self, role: str, route: Route, body: dict[str, Any], session: str | None) -> str | None:
        name = self.pool.policy_names.get(role)
        if name == "session_affinity":
            return session
        if name != "prefix_affinity":
            return None
        n = self.cfg.prefix_affinity_tokens
        prompt: Any = body.get("messages") if route == "chat" else body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return ",".join(map(str, prompt[:n]))
        return json.dumps(prompt, sort_keys=True, default=str)[: 4 * n]

    async def handle(self, route: Route, body: dict[str, Any], request_id: str,
                     session: str | None = None) -> UpstreamReply:
        handoff.check_request(route, body)
        self._admit()
        slots = {"prefill": True, "decode": True}
        try:
            n_prompt = self.lengths.count(route, body) if self.cfg.local_prefill_below_tokens else None
            plan = handoff.plan(route, body, prompt_tokens=n_prompt,
                                local_below=self.cfg.local_prefill_below_tokens)
            reply = await self._legs(route, body, request_id, session, plan, time.perf_counter(), slots)
        except BaseException:
            self._release(slots, "prefill")
            self._release(slots, "decode")
            raise
        if reply.stream is None:
            self._release(slots, "decode")
        # A stream gives its decode slot back when it ends (in _timed).
        return reply

    def _release(self, slots: dict[str, bool], role: str) -> None:
        if slots[role]:
            slots[role] = False
            self.admitted[role] -= 1

    async def _legs(self, route: Route, body: dict[str, Any], request_id: str, session: str | None,
                    plan: handoff.Plan, t0: float, slots: dict[str, bool]) -> UpstreamReply:
        m = self.metrics
        kv: dict[str, Any] | None = None
        lease: Lease | None = None
        reason = plan.reason
        if plan.disaggregate:
            if self.pool.has("prefill"):
                m.inflight.labels("prefill").inc()
                try:
                    kv, lease = await self._prefill(route, body, request_id,
                                                    self.routing_key("prefill", route, body, session))
                finally:
                    m.inflight.labels("prefill").dec()
                m.phase.labels("prefill").observe(time.perf_counter() - t0)
                if kv is None:
                    reason = "prefill_fallback_or_no_kv"
            else:
                if self.cfg.prefill_fallback == "error":
                    raise NoEngineAvailable("no healthy prefill engine is available")
                # No healthy prefill engine: the decode engine computes the prompt itself.
                self.stats["prefill_fallback"] += 1
                m.errors.labels("no_prefill_engine").inc()
                reason = "no_prefill_engine"
                log.warning("request %s: no healthy prefill engine, prefilling on decode", request_id)
        self._release(slots, "prefill")
        self.stats["pd" if kv is not None else "local"] += 1
        m.decisions.labels("pd" if kv is not None else "local", reason).inc()
        dbody = handoff.decode_body(body, kv) if kv is not None else body
        t_dec = time.perf_counter()
        m.inflight.labels("decode").inc()
        stream = bool(body.get("stream"))
        key = self.routing_key("decode", route, body, session)

        async def recompute() -> UpstreamReply:
            # The pulled blocks may belong to another request by now: decode computes the prompt itself.
            log.warning("request %s: KV lease on %s not held through the handoff; recomputing the prompt",
                        request_id, lease.ep.url if lease else "?")
            m.decisions.labels("local", "kv_lease_lost").inc()
            return await self._decode(route, body, request_id, stream=stream, key=key)

        try:
            reply = await self._decode(route, dbody, request_id, stream=stream, key=key)
            if reply.stream is None and reply.status == 200 and await self._lease_lost(lease, request_id):
                reply = await recompute()
        except BaseException:
            m.inflight.labels("decode").dec()
            raise
        if reply.stream is None:
            m.inflight.labels("decode").dec()
            now = time.perf_counter()
            m.phase.labels("decode").observe(now - t_dec)
            m.e2e.labels(route).observe(now - t0)
            if reply.status == 200 and reply.body:
                self._observe_tpot(route, reply.body, now - t0)
            return reply
        if lease is not None:
            reply.stream = self._lease_guarded(reply.stream, lease, request_id, recompute)
        reply.stream = self._timed(route, reply.stream, t0, t_dec, kv is not None, slots)
        return reply

    async def _lease_lost(self, lease: Lease | None, request_id: str) -> bool:
        """Whether the prefill blocks this request's decode pulled may have been freed first.

        Only a handoff slower than ``lease_check_after_s`` is checked (a lease cannot run out sooner); the
        prefill engine answers from vLLM's own record of expired leases. No answer counts as lost: the
        price of a needless recompute is one prefill, the price of a wrong guess is wrong tokens."""
        if lease is None or self.lease_check_after_s is None:
            return False
        if time.perf_counter() - lease.since < self.lease_check_after_s:
            return False
        outcome = "unknown"
        try:
            s = await self.session()
            async with s.get(f"{lease.ep.url}/pdserve/kv-lease/{lease.request_id}",
                             timeout=aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s)) as r:
                if r.status == 200:
                    ans = await r.json()
                    outcome = "expired" if ans.get("expired") or ans.get("read_after_expiry") else "held"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.warning("request %s: KV lease check on %s failed: %s", request_id, lease.ep.url, e)
        self.metrics.kv_lease.labels(outcome).inc()
        return outcome != "held"

    async def _lease_guarded(self, stream: AsyncIterator[bytes], lease: Lease, request_id: str,
                             recompute: Any) -> AsyncIterator[bytes]:
        """Hold decode's first chunk until the lease is known to have held; else replace the stream."""
        it = stream.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        if not await self._lease_lost(lease, request_id):
            yield first
            async for chunk in it:
                yield chunk
            return
        await stream.aclose()  # type: ignore[attr-defined]
        try:
            again: UpstreamReply = await recompute()
        except RequestError as e:
            again = UpstreamReply(status=e.status_code, body=json.dumps(
                {"error": {"message": e.message, "type": e.error_type, "param": None, "code": e.status_code}}).encode())
        if again.stream is None:
            # Headers are out already: the failure travels in-band, like any mid-stream error.
            try:
                err = json.loads(again.body or b"{}")
            except ValueError:
                err = {"error": {"message": "decode engine failed", "type": "upstream_error", "code": again.status}}
            yield f"data: {json.dumps(err)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            return
        async for chunk in again.stream:
            yield chunk

    def _observe_tpot(self, route: Route, raw: bytes, e2e: float) -> None:
        try:
            n = int(json.loads(raw).get("usage", {}).get("completion_tokens", 0))
        except (ValueError, AttributeError, TypeError):
            return
        if n > 1:
            self.metrics.tpot.labels(route).observe(e2e / n)

    async def _timed(self, route: Route, stream: AsyncIterator[bytes], t0: float, t_dec: float,
                     pd: bool, slots: dict[str, bool]) -> AsyncIterator[bytes]:
        m = self.metrics
        first: float | None = None
        events = 0
        try:
            async for chunk in stream:
                if first is None:
                    first = time.perf_counter()
                    m.ttft.labels(route).observe(first - t0)
                    m.phase.labels("kv_handoff" if pd else "local_prefill").observe(first - t_dec)
                events += chunk.count(b"data: ")
                yield chunk
        finally:
            self._release(slots, "decode")
            m.inflight.labels("decode").dec()
            end = time.perf_counter()
            m.e2e.labels(route).observe(end - t0)
            if first is not None:
                m.phase.labels("decode").observe(end - first)
                tokens = events - 2  # less [DONE] and the first token
                if tokens > 0:
                    m.tpot.labels(route).observe((end - first) / tokens)

    async def _prefill(self, route: Route, body: dict[str, Any], request_id: str,
                       key: str | None = None) -> tuple[dict[str, Any] | None, Lease | None]:
        pbody = handoff.prefill_body(route, body)
        tried: set[str] = set()
        while True:
            try:
                ep = self.pool.pick("prefill", exclude=tried, key=key)
            except NoEngineAvailable:
                if self.cfg.prefill_fallback == "error":
                    raise
                self.stats["prefill_fallback"] += 1
                log.warning("request %s: every prefill engine failed, prefilling on decode", request_id)
                return None, None
            tried.add(ep.url)
            try:
                status, raw, _ = await self._post_json(ep, route, pbody, request_id, self.cfg.prefill_timeout_s)
            except (UpstreamError, UpstreamTimeout) as e:
                log.warning("request %s: prefill on %s failed (%s); trying another", request_id, ep.url, e)
                self.pool.mark_failed(ep)
                continue
            if status >= 500:
                log.warning("request %s: prefill on %s answered %d; trying another", request_id, ep.url, status)
                continue
            if status != 200:
                raise EngineAnswer(status, raw, "application/json")
            try:
                answer = json.loads(raw)
            except ValueError as e:
                raise UpstreamError(f"prefill engine returned invalid JSON: {e}") from e
            kv = handoff.usable_kv_params(answer.get("kv_transfer_params"))
            if kv is None:
                # Nothing to hand over (e.g. the prompt fit no block): decode computes the prompt.
                self.stats["no_kv_params"] += 1
                return None, None
            return kv, Lease(ep, str(kv.get("remote_request_id", "")), time.perf_counter())

    async def _post_json(
        self, ep: Endpoint, route: Route, body: dict[str, Any], request_id: str, timeout_s: float
    ) -> tuple[int, bytes, str]:
        s = await self.session()
        ep.inflight += 1
        try:
            async with s.post(
                ep.url + PATHS[route],
                data=json.dumps(body),
                headers={"Content-Type": "application/json", "X-Request-Id": request_id},
                timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.cfg.connect_timeout_s),
            ) as r:
                raw = await r.read()
                return r.status, raw, r.headers.get("Content-Type", "application/json")
        except asyncio.TimeoutError as e:
            raise UpstreamTimeout(f"{ep.role} engine did not answer within {timeout_s:g}s") from e
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamError(f"{ep.role} engine at {ep.url} failed: {e}") from e
        finally:
            ep.inflight -= 1

    async def _decode(self, route: Route, body: dict[str, Any], request_id: str, *, stream: bool,
                      key: str | None = None) -> UpstreamReply:
        tried: set[str] = set()
        last: RequestError | None = None
        while True:
            try:
                ep = self.pool.pick("decode", exclude=tried, key=key)
            except NoEngineAvailable:
                if last is not None:
                    raise last from None
                raise
            tried.add(ep.url)
            try:
                if stream:
                    return await self._decode_stream(ep, route, body, request_id)
                status, raw, ctype = await self._post_json(ep, route, body, request_id, self.cfg.decode_timeout_s)
            except (UpstreamError, UpstreamTimeout) as e:
                # Nothing reached the client yet: another decode replica may take it.
                self.pool.mark_failed(ep)
                last = e
                continue
            return UpstreamReply(status=status, body=raw, content_type=ctype)

    async def _decode_stream(
        self, ep: Endpoint, route: Route, body: dict[str, Any], request_id: str
    ) -> UpstreamReply:
        s = await self.session()
        timeout = self.cfg.decode_timeout_s
        ep.inflight += 1
        try:
            resp = await s.post(
                ep.url + PATHS[route],
                data=json.dumps(body),
                headers={"Content-Type": "application/json", "X-Request-Id": request_id},
                timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=self.cfg.connect_timeout_s),
            )
        except asyncio.TimeoutError as e:
            ep.inflight -= 1
            raise UpstreamTimeout(f"decode engine did not answer within {timeout:g}s") from e
        except (aiohttp.ClientError, OSError) as e:
            ep.inflight -= 1
            raise UpstreamError(f"decode engine at {ep.url} failed: {e}") from e
        if resp.status != 200:
            try:
                raw = await resp.read()
            finally:
                resp.release()
                ep.inflight -= 1
            return UpstreamReply(status=resp.status, body=raw, content_type=resp.headers.get("Content-Type", ""))

        async def relay() -> AsyncIterator[bytes]:
            started = time.monotonic()
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                # Mid-stream failure: tell the client in-band, then end the stream.
                log.warning("request %s: decode stream broke after %.1fs: %s", request_id,
                            time.monotonic() - started, e)
                err = {"error": {"message": f"decode engine failed mid-stream: {e}", "type": "upstream_error",
                                 "param": None, "code": 502}}
                yield f"data: {json.dumps(err)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                if resp.content.at_eof():
                    resp.release()
                else:
                    # The client left (or the stream broke): closing the connection makes the decode
                    # engine abort the request and free its blocks.
                    resp.close()
                ep.inflight -= 1

        return UpstreamReply(status=200, stream=relay(), content_type="text/event-stream")
