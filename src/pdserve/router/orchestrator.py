"""Runs one client request through the prefill and decode legs.

The router talks to the engines' own OpenAI servers over plain HTTP (aiohttp, pooled keep-alive
connections): the data path is the same two calls a hand-written handoff client makes, with nothing in
between. Streaming bytes from the decode engine are passed to the client as they arrive, unparsed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from pdserve.config.schema import RouterConfig
from pdserve.config.tenants import DEFAULT_TENANT
from pdserve.errors import (
    BadRequest,
    NoEngineAvailable,
    NotFound,
    Overloaded,
    RequestError,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
)
from pdserve.router import admission, early, handoff, migrate, validate
from pdserve.router.effect import PdEffect
from pdserve.router.flight import Flight
from pdserve.router.handoff import Route
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Endpoint, EnginePool, Role
from pdserve.router.prompt_length import PromptLength
from pdserve.router.routing import RoutingKey, RoutingRequest
from pdserve.router.stored import StoredResponses
from pdserve.router.tenants import Tenants

log = logging.getLogger(__name__)

#: Prompt tokens of the calibration request a new engine gets, and how often it is tried.
CALIBRATION_TOKENS = 512
# How long the router keeps an idle engine connection: below the engines' own keep-alive
# (pdserve.engine.launcher.ENGINE_KEEP_ALIVE_S), so the engine is not the side that closes it.
ROUTER_KEEP_ALIVE_S = 20.0
CALIBRATION_TRIES = 3
CALIBRATION_OUTPUT_TOKENS = 33
#: ``local_prefill_below_tokens: auto``: a prompt is computed on the decode engine itself when that holds its
#: streams up for less than this many of its idle decode steps (the handoff itself costs about one).
AUTO_LOCAL_STEPS = 2.0
#: Longest a chat prompt's rendering (for routing by cached prefix) may take before the request is routed
#: by load instead (it goes on in its worker thread; the event loop never waits for it).
RENDER_TIMEOUT_S = 2.0
#: A non-streamed P/D answer's decode leg includes the handoff (the KV pull and decode's first step, over a
#: second for a 1,500-token prompt on a slow CPU host), which its tokens alone cannot be told apart from: its
#: time per token teaches decode's speed only when at least this many tokens spread the handoff out. (Two
#: tokens each made decode's TPOT 1.28 s on such a host, and admission's ``max_tpot_s`` then refused
#: every request.)
WHOLE_ANSWER_TPOT_MIN_TOKENS = 16

PATHS: dict[Route, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                           "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass
class UpstreamReply:
    """What the router hands back: a finished body or a byte stream, with status and headers."""

    status: int
    body: bytes | None = None
    stream: AsyncIterator[bytes] | None = None
    content_type: str = "application/json"
    flight: Flight | None = None  # a stream's claims, released when the response ends
    endpoint: Endpoint | None = None  # the decode engine that answered


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
                 lengths: PromptLength | None = None, lease_check_after_s: float | None = None,
                 *, lease_s: float | None = None, model_id: str | None = None,
                 on_calibrated: Callable[[Endpoint, float], None] | None = None,
                 limits: validate.EngineLimits | None = None, chat_parsers: bool = False) -> None:
        self.pool = pool
        # The engines run a reasoning or tool-call parser: chat content may be withheld (router/early.py).
        self.chat_parsers = chat_parsers
        self.cfg = cfg
        pool.configure(cfg.plugins)  # the routing plugins' settings (router.plugins)
        # A handoff slower than this (seconds from the prefill answer to decode's first byte) is checked
        # against the prefill engine's KV lease; None turns the check off.
        self.lease_check_after_s = lease_check_after_s
        # The prefill engines' KV lease: decode must pull well within it (admission checks decode's queue).
        self.lease_s = lease_s
        self.model_id = model_id
        self.on_calibrated = on_calibrated
        self.lengths = lengths or PromptLength()
        # What the engines accept: checked before the first leg, so no prefill is spent on a refused request.
        self.validator = validate.RequestValidator(self.lengths, limits)
        self.metrics = metrics or RouterMetrics()
        self._session: aiohttp.ClientSession | None = None
        # Requests admitted and not finished, per role (a request holds its prefill slot until its
        # prefill leg ends, its decode slot until the answer is complete).
        self.admitted: dict[str, int] = {"prefill": 0, "decode": 0}
        self.stats: dict[str, int] = {"pd": 0, "local": 0, "prefill_fallback": 0, "no_kv_params": 0}
        self._calibrating: dict[str, asyncio.Task[None]] = {}
        self.effect = PdEffect()
        self.stored = StoredResponses()  # which decode engine keeps each stored Responses answer
        self.tenants = Tenants(cfg)  # each tenant's limits and share (router/tenants.py)
        self.tenants.on_admitted = lambda t, p, o: self.metrics.tenant_admitted(t, p, o)
        self.tenants.on_refused = lambda t, cause: self.metrics.tenant_refused.labels(t, cause).inc()
        #: Set when the router shuts down: new requests get a 503, not a new connection pool.
        self.closing = False

    async def session(self) -> aiohttp.ClientSession:
        if self.closing:
            raise ShuttingDown()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                # Idle connections are dropped well before the engines drop them (ENGINE_KEEP_ALIVE_S), so
                # the router rarely reuses one the engine is closing; stale_connection() covers the rest.
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=ROUTER_KEEP_ALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        self.closing = True
        if self._session is not None:
            await self._session.close()

    async def check(self, ep: Endpoint) -> bool:
        """Health probe; a healthy engine whose speed is not known yet is also calibrated."""
        try:
            s = await self.session()
            async with s.get(ep.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ShuttingDown):
            return False
        if (ok and ep.load.calibrated_rate is None and ep.key not in self._calibrating
                and ep.load.calibration_failures < CALIBRATION_TRIES):
            task = asyncio.get_running_loop().create_task(self.calibrate(ep))
            self._calibrating[ep.key] = task
            task.add_done_callback(lambda _t, k=ep.key: self._calibrating.pop(k, None))
        return ok

    async def calibrate(self, ep: Endpoint, tokens: int = CALIBRATION_TOKENS) -> float | None:
        """Measure a new engine's prompt speed with one prompt of ``tokens`` random token ids (random, so no
        prefix cache answers it) and one output token, before admission relies on it. A first prompt of
        the same length warms the engine and is not timed: an engine's first prompts pay one-time costs
        (kernels built for new shapes, allocator growth), and a first measurement that included them read
        6 tokens/s where the engine computed ~1,000, and admission refused long prompts until real ones
        had measured it again. Returns prompt tokens/s, or None when the engine did not answer."""
        prompt = [random.randrange(100, 1000) for _ in range(tokens)]
        try:
            await self._probe(ep, [random.randrange(1000, 2000) for _ in range(tokens)], 1,
                              self.cfg.prefill_timeout_s)
            status, raw, took = await self._probe(ep, prompt, 1, self.cfg.prefill_timeout_s)
        except (UpstreamError, UpstreamTimeout) as e:
            ep.load.calibration_failures += 1
            log.warning("calibrating %s engine at %s failed: %s", ep.role, ep.url, e)
            return None
        if status != 200:
            # E.g. a max_model_len shorter than the prompt: after a few tries admission goes on without
            # a speed (one prompt at a time per engine) until real prompts have measured it.
            ep.load.calibration_failures += 1
            log.warning("calibrating %s engine at %s: it answered %d: %s", ep.role, ep.url, status, raw[:200])
            return None
        n = _usage(raw).get("prompt_tokens") or tokens
        rate = n / max(took, 1e-6)
        if ep.role == "decode" and ep.load.tpot_single is None:
            ep.load.tpot_single = await self._calibrate_tpot(ep)
        ep.load.calibrated_rate = rate
        log.info("%s engine at %s computes %.0f prompt tokens/s (%d tokens in %.2fs)", ep.role, ep.url, rate,
                 n, took)
        if self.on_calibrated is not None:
            self.on_calibrated(ep, rate)
        return rate

    async def _calibrate_tpot(self, ep: Endpoint, out: int = CALIBRATION_OUTPUT_TOKENS) -> float | None:
        """A decode engine's time per output token with one stream: the idle figure admission compares a
        crowded engine with. Two requests, 1 and ``out`` tokens, so the prompt's cost cancels."""
        prompt = [random.randrange(100, 1000) for _ in range(16)]
        took: list[float] = []
        for n in (1, out):
            try:
                status, _, secs = await self._probe(ep, prompt, n, self.cfg.decode_timeout_s)
            except (UpstreamError, UpstreamTimeout):
                return None
            if status != 200:
                return None
            took.append(secs)
        return max(took[1] - took[0], 1e-4) / (out - 1)

    async def _probe(self, ep: Endpoint, prompt: list[int], max_tokens: int, timeout_s: float
                     ) -> tuple[int, bytes, float]:
        """One calibration request straight to an engine: (status, body, seconds it took)."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        if self.model_id:
            body["model"] = self.model_id
        t = time.perf_counter()
        status, raw, _ = await self._post_json(ep, "completions", body, f"pdserve-calibrate-{ep.engine_id}",
                                               timeout_s)
        return status, raw, time.perf_counter() - t

    # -- the flow -------------------------------------------------------------------------------

    def _admit_count(self, prompt_tokens: int, new_tokens: int) -> Flight:
        """The router's and each role's in-flight count bounds (hard caps beside admission by work)."""
        if self.admitted["decode"] >= self.cfg.max_inflight:
            self._refused("router_full")
            raise Overloaded(f"the router holds {self.cfg.max_inflight} requests; retry shortly")
        for role, per in (("decode", self.cfg.max_inflight_per_decode_engine),
                          ("prefill", self.cfg.max_inflight_per_prefill_engine)):
            healthy = self.pool.healthy(role)  # type: ignore[arg-type]
            if healthy and self.admitted[role] >= per * len(healthy):
                self._refused(f"{role}_full")
                raise Overloaded(f"all {role} engines are at their in-flight limit ({per} each); retry shortly")
        return Flight(self.admitted, self.metrics, prompt_tokens, new_tokens)

    def local_below(self) -> int:
        """Prompts shorter than this are computed on decode (``router.local_prefill_below_tokens``; ``auto``:
        from the decode engines' measured speeds, the most cautious of them, 0 until one is measured)."""
        v = self.cfg.local_prefill_below_tokens
        if v != "auto":
            return int(v)
        sizes = [int(ep.load.calibrated_rate * ep.load.tpot_single * AUTO_LOCAL_STEPS)
                 for ep in self.pool.healthy("decode") if ep.load.calibrated_rate and ep.load.tpot_single]
        return min(sizes, default=0)

    def _refused(self, cause: str) -> None:
        self.metrics.refused.labels(cause).inc()
        self.metrics.errors.labels(cause).inc()

    def routing_key(self, role: str, route: Route, body: dict[str, Any], session: str | None,
                    ids: list[int] | None) -> RoutingKey:
        """What ``role``'s routing plugin needs from this request (e.g. a prompt prefix, the session id, the
        prompt's token ids: ``ids``, from :meth:`prompt_ids`, given to the roles that want them)."""
        ids = ids if self.pool.wants_prompt_ids(role) else None
        return self.pool.routing_key(role, RoutingRequest(route, body, session, ids))  # type: ignore[arg-type]

    async def prompt_ids(self, route: Route, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids for routing by cached prefix. A chat prompt's are rendered through the
        model's chat template in a worker thread, never on the event loop, and given up after
        :data:`RENDER_TIMEOUT_S` (the request is then routed by load): a template and a conversation are
        bounded by the body's size, but the loop also serves every other request and /health."""
        if route != "chat":
            return self.lengths.token_ids(route, body)
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.lengths.token_ids, route, body), RENDER_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("rendering a chat prompt took over %.0f s; routed by load", RENDER_TIMEOUT_S)
            return None

    async def handle(self, route: Route, body: dict[str, Any], request_id: str,
                     session: str | None = None, owner: str = "", tenant: str = DEFAULT_TENANT) -> UpstreamReply:
        """Admit and run one request. A streamed reply carries its :class:`Flight`: whoever sends the
        stream releases it when the response ends (the stream's own end releases it too)."""
        t0 = time.perf_counter()
        self.tenants.precheck(tenant)  # a tenant over a limit is refused before the costly checks
        if self.tenants.enabled and self.tenants.outranked(tenant):
            # The priority hold, from the router's quick count, before vLLM's request models run: a flood of
            # long lower-priority prompts costs the router (and the engines' cores) little to refuse.
            try:
                quick, _ = self.lengths.measure(route, body)
            except Exception:  # noqa: BLE001 - a body the checks below refuse properly
                quick = 0
            self.tenants.hold(tenant, self._engine_seconds(quick))
        n_prompt = self.validator.check(route, body)
        if route == "responses":
            self._check_response_ids(body, owner)
            prev = body.get("previous_response_id")
            if isinstance(prev, str):
                # The engine reads the whole stored conversation again, not only the new input.
                n_prompt += self.stored.context_tokens(prev, owner)
        n_new = handoff.max_new_tokens(route, body) or 0
        if self.tenants.enabled:
            self.tenants.hold(tenant, self._engine_seconds(n_prompt))  # the priority hold (router/tenants.py)
        ticket = self.tenants.admit(tenant, n_prompt, n_new)  # 429 when the tenant is over a limit
        try:
            flight = self._admit_count(n_prompt, n_new)
        except BaseException:
            self.tenants.refund(ticket, n_prompt, n_new)
            self.tenants.release(ticket)
            raise
        flight.also(lambda: self.tenants.release(ticket))
        if (salt := self.tenants.salt(tenant, body.get("cache_salt"))) is not None:
            body["cache_salt"] = salt  # the tenant's own prefix cache (router/tenants.py)
        scale = self.tenants.wait_scale(tenant)
        cfg = self.cfg if scale >= 1.0 else self.cfg.model_copy(
            update={"max_queue_wait_s": self.cfg.max_queue_wait_s * scale})
        try:
            plan = handoff.plan(route, body, prompt_tokens=n_prompt, local_below=self.local_below())
            ids = (await self.prompt_ids(route, body)
                   if self.pool.wants_prompt_ids("decode") or self.pool.wants_prompt_ids("prefill") else None)
            decode_key = self.routing_key("decode", route, body, session, ids)
            prefill_key = self.routing_key("prefill", route, body, session, ids)
            try:
                adm = admission.admit(
                    self.pool, cfg, disaggregate=plan.disaggregate, reason=plan.reason,
                    prompt_tokens=n_prompt, lease_s=self.lease_s,
                    new_tokens=n_new,
                    prefill_key=prefill_key,
                    decode_key=decode_key,
                    local_if_idle=(plan.reason == handoff.SHORT_PROMPT
                                   and self.cfg.local_prefill_below_tokens == "auto"))
            except admission.Refused as e:
                self._refused(e.cause)
                self.tenants.refund(ticket, n_prompt, n_new)
                self.tenants.refused(tenant, e.cause)
                raise
            if plan.reason == "previous_response":
                # Only the engine that stored the earlier response can continue it.
                held = self.stored.where(str(body["previous_response_id"]), self._answering(), owner)
                if held is not None:
                    adm = admission.Admitted(None, held, plan.reason)
            reply = await self._legs(route, body, request_id, adm, flight, t0, decode_key, owner)
        except BaseException:
            flight.release()
            raise
        if reply.stream is None:
            flight.release()
        else:
            reply.flight = flight
        return reply

    async def _legs(self, route: Route, body: dict[str, Any], request_id: str, adm: admission.Admitted,
                    flight: Flight, t0: float, key: RoutingKey, owner: str = "") -> UpstreamReply:
        m = self.metrics
        kv: dict[str, Any] | None = None
        lease: Lease | None = None
        reason = adm.reason
        first: early.FirstToken | None = None
        if adm.prefill is not None:
            flight.bound_for(adm.decode)
            at_once = self.cfg.early_first_token and early.eligible(route, body, chat_parsers=self.chat_parsers)
            if at_once:
                body = early.seeded(body)
            # The first token's and the prompt's ids let the stream go on from that token (router/early.py).
            pbody = {**body, "return_token_ids": True} if at_once else body
            kv, lease, answer = await self._prefill(route, pbody, request_id, adm.prefill, flight)
            if at_once and kv is not None and answer is not None:
                first = early.from_prefill(route, answer)
            m.phase.labels("prefill").observe(time.perf_counter() - t0)
            if kv is None:
                reason = "prefill_fallback_or_no_kv"
        elif reason in ("no_prefill_engine", "prefill_busy"):
            self.stats["prefill_fallback"] += 1
            m.errors.labels(reason).inc()
            log.info("request %s: %s, prefilling on decode", request_id, reason.replace("_", " "))
        flight.end_slot("prefill")
        self.stats["pd" if kv is not None else "local"] += 1
        m.decisions.labels("pd" if kv is not None else "local", reason).inc()
        self.effect.record("pd" if kv is not None else "local", reason)
        m.pd_share.set(self.effect.share() or 0.0)
        stream = bool(body.get("stream"))
        # A stream that may move to another engine if its decode engine fails: its engine returns token ids.
        movable = self.cfg.migrate_streams and migrate.eligible(route, body, chat_parsers=self.chat_parsers)
        client_body = body
        if movable:
            body = migrate.tracked(body)
        dbody = handoff.decode_body(body, kv) if kv is not None else body
        t_dec = time.perf_counter()
        local = kv is None

        async def recompute() -> UpstreamReply:
            # The pulled blocks may belong to another request by now: decode computes the prompt itself.
            log.warning("request %s: KV lease on %s not held through the handoff; recomputing the prompt",
                        request_id, lease.ep.url if lease else "?")
            m.decisions.labels("local", "kv_lease_lost").inc()
            self.effect.record("local", "kv_lease_lost")
            return await self._decode(route, body, request_id, stream=stream, first=adm.decode, key=key,
                                      flight=flight, local=True)

        reply = await self._decode(route, dbody, request_id, stream=stream, first=adm.decode, key=key,
                                   flight=flight, local=local)
        if route == "responses" and reply.status == 200 and reply.endpoint is not None:
            if reply.stream is None:
                self.stored.from_body(reply.body, reply.endpoint, owner)
            else:
                reply.stream = self.stored.sniff(reply.stream, reply.endpoint, owner)
        if reply.stream is None and reply.status == 200 and await self._lease_lost(lease, request_id):
            reply = await recompute()
        if reply.stream is None:
            now = time.perf_counter()
            m.phase.labels("decode").observe(now - t_dec)
            m.e2e.labels(route).observe(now - t0)
            usage = _usage(reply.body) if reply.status == 200 else {}
            # A whole answer says nothing of the prompt's speed: its time is mostly decoding. (A stream's first
            # token marks its prompt's end; a non-streamed local answer only leaves the queue here.)
            flight.end_prompt(None)
            n_out = usage.get("completion_tokens", 0)
            if n_out > 1:
                m.tpot.labels(route).observe((now - t0) / n_out)
            teaches = n_out >= WHOLE_ANSWER_TPOT_MIN_TOKENS and not local
            flight.end_stream((now - t_dec) / n_out if teaches else None)
            return reply
        if movable and reply.endpoint is not None:
            reply.stream = migrate.resilient(route, client_body, reply.stream,
                                             self._resumer(request_id, {reply.endpoint.url}, flight),
                                             lambda outcome: m.migrations.labels(outcome).inc())
        reply.stream = _in_band(reply.stream, request_id)
        if lease is not None:
            reply.stream = self._lease_guarded(reply.stream, lease, request_id, recompute)
        decode_first: list[float] = []
        if first is not None:
            # The client's first token is the prefill leg's; the handoff and decode's pace are timed on
            # decode's own first byte.
            redo = None
            if (first.token_id is not None and first.prompt_ids and reply.endpoint is not None
                    and migrate.eligible(route, client_body, chat_parsers=self.chat_parsers)):
                redo = self._from_first(route, client_body, first, reply.endpoint, request_id, flight, movable)
            reply.stream = early.splice(route, first, _first_byte_at(reply.stream, decode_first),
                                        lambda outcome: m.early_token.labels(outcome).inc(), redo)
        reply.stream = self._timed(route, reply.stream, t0, t_dec, not local, flight, decode_first)
        return reply

    def _from_first(self, route: Route, body: dict[str, Any], first: early.FirstToken, ep: Endpoint,
                    request_id: str, flight: Flight, movable: bool) -> early.Redo:
        """The stream that goes on from the prefill's first token on decode engine ``ep`` when decode
        computed another first token (router/early.py): a token-id completion of the prompt's ids and that
        token, its events in the client's API. It may move on if ``ep`` fails (when ``movable``)."""

        async def redo() -> AsyncIterator[bytes]:
            assert first.prompt_ids is not None and first.token_id is not None
            log.info("request %s: decode's first token differs from the prefill's; going on from the prefill's",
                     request_id)
            tape = migrate.Tape.sent(route, body, first.prompt_ids, [first.token_id], first.head())
            cbody = migrate.continuation(route, body, tape)
            if cbody is None:  # the one token was the whole answer
                return _once(tape.closing())
            tape.continuing()
            reply = await self._decode_stream(ep, "completions", cbody, request_id)
            if reply.status != 200 or reply.stream is None:
                raise UpstreamError(f"decode engine {ep.url} answered {reply.status}: {(reply.body or b'')[:200]!r}")
            if movable:
                resume = self._resumer(request_id, {ep.url}, flight)
                on_move = lambda outcome: self.metrics.migrations.labels(outcome).inc()  # noqa: E731
            else:
                resume, on_move = _no_resume, None
            return _in_band(migrate.resilient(route, body, reply.stream, resume, on_move, tape=tape), request_id)

        return redo

    def _resumer(self, request_id: str, tried: set[str], flight: Flight) -> migrate.Resume:
        """Where a broken stream goes on: another decode replica, else a prefill engine (the same model)."""

        async def resume(route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
            for role in ("decode", "prefill"):
                while True:
                    try:
                        ep = self.pool.pick(role, exclude=tried)  # type: ignore[arg-type]
                    except NoEngineAvailable:
                        break
                    tried.add(ep.url)
                    try:
                        reply = await self._decode_stream(ep, route, body, request_id)
                    except (UpstreamError, UpstreamTimeout) as e:
                        log.warning("request %s: %s engine %s cannot continue the stream: %s", request_id, role,
                                    ep.url, e)
                        self.pool.mark_failed(ep)
                        continue
                    if reply.status != 200 or reply.stream is None:
                        log.warning("request %s: %s engine %s answered %d to the stream's continuation: %s",
                                    request_id, role, ep.url, reply.status, (reply.body or b"")[:200])
                        continue
                    log.warning("request %s: the stream goes on on %s engine %s", request_id, role, ep.url)
                    flight.start_stream(ep)
                    return reply.stream
            raise NoEngineAvailable("no other engine is healthy")

        return resume

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
            async with s.get(f"{lease.ep.url}/pdserve/kv-lease/{quote(lease.request_id, safe='')}",
                             headers=lease.ep.auth(),
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

    async def _timed(self, route: Route, stream: AsyncIterator[bytes], t0: float, t_dec: float,
                     pd: bool, flight: Flight, decode_first: list[float] | None = None) -> AsyncIterator[bytes]:
        """Times the stream the client reads. ``decode_first``: filled with the time of the decode engine's
        first byte when the client's first token came from elsewhere (the prefill leg's, sent early); the
        handoff, decode and time-per-token figures (which admission learns from) start there."""
        m = self.metrics
        first: float | None = None
        events = 0
        try:
            async for chunk in stream:
                if first is None:
                    first = time.perf_counter()
                    m.ttft.labels(route).observe(first - t0)
                    # A prompt computed on decode is done once its first token is out.
                    flight.end_prompt(flight.prompt_tokens)
                    if not decode_first:
                        m.phase.labels("kv_handoff" if pd else "local_prefill").observe(first - t_dec)
                events += chunk.count(b"data: ")
                yield chunk
        finally:
            end = time.perf_counter()
            m.e2e.labels(route).observe(end - t0)
            tpot = None
            if decode_first:
                first = decode_first[0]
                m.phase.labels("kv_handoff").observe(first - t_dec)
            if first is not None:
                m.phase.labels("decode").observe(end - first)
                tokens = events - 2  # less [DONE] and the first token
                if tokens > 0:
                    tpot = (end - first) / tokens
                    m.tpot.labels(route).observe(tpot)
            flight.end_stream(tpot)
            flight.release()

    async def _prefill(self, route: Route, body: dict[str, Any], request_id: str, first: Endpoint,
                       flight: Flight) -> tuple[dict[str, Any] | None, Lease | None, dict[str, Any] | None]:
        """The prefill leg on ``first``, then on other replicas if it fails. ``(None, None)`` when decode
        is to compute the prompt itself: prefill answered without usable KV params, or every prefill
        replica failed and decode has room for the prompt (else the request fails: no cascade). The third
        item is the prefill engine's answer (it holds the first token)."""
        pbody = handoff.prefill_body(route, body)
        tried: set[str] = set()
        ep: Endpoint | None = first
        while True:
            if ep is None:
                try:
                    ep = self.pool.pick("prefill", exclude=tried)
                except NoEngineAvailable:
                    flight.end_prompt(None)
                    return self._prefill_fallback(request_id)
            tried.add(ep.url)
            flight.queue_prompt(ep)
            try:
                status, raw, _ = await self._post_json(ep, route, pbody, request_id, self.cfg.prefill_timeout_s)
            except (UpstreamError, UpstreamTimeout) as e:
                log.warning("request %s: prefill on %s failed (%s); trying another", request_id, ep.url, e)
                self.pool.mark_failed(ep)
                ep = None
                continue
            if status >= 500:
                log.warning("request %s: prefill on %s answered %d; trying another", request_id, ep.url, status)
                ep = None
                continue
            if status != 200:
                flight.end_prompt(None)
                raise EngineAnswer(status, raw, "application/json")
            try:
                answer = json.loads(raw)
            except ValueError as e:
                flight.end_prompt(None)
                raise UpstreamError(f"prefill engine returned invalid JSON: {e}") from e
            flight.end_prompt(_usage(raw).get("prompt_tokens") or flight.prompt_tokens)
            kv = handoff.usable_kv_params(answer.get("kv_transfer_params"))
            if kv is None:
                # Nothing to hand over (e.g. the prompt fit no block): decode computes the prompt.
                self.stats["no_kv_params"] += 1
                return None, None, answer
            return kv, Lease(ep, str(kv.get("remote_request_id", "")), time.perf_counter()), answer

    def _prefill_fallback(self, request_id: str) -> tuple[None, None, None]:
        """Every prefill replica failed this request: decode computes the prompt only if it has room."""
        if self.cfg.prefill_fallback == "error":
            raise NoEngineAvailable("every prefill engine failed this request")
        limit = self.cfg.max_queue_wait_s
        if not any(d.load.wait_s() <= limit for d in self.pool.healthy("decode")):
            self._refused("prefill_failed_decode_busy")
            raise NoEngineAvailable("every prefill engine failed this request and decode has no room for its "
                                    "prompt; retry shortly")
        self.stats["prefill_fallback"] += 1
        log.warning("request %s: every prefill engine failed, prefilling on decode", request_id)
        return None, None, None

    def _answering(self) -> list[Endpoint]:
        """Engines that may hold a stored response: decode engines, and prefill engines that answered whole
        requests (``router.disaggregate_by_load``)."""
        return self.pool.healthy("decode") + self.pool.healthy("prefill")

    def _engine_seconds(self, prompt_tokens: int) -> float:
        """How long a prompt would hold the least busy prefill engine (its queue's wait, then the prompt, at
        the measured speed); 0 when no speed is known yet."""
        eps = self.pool.healthy("prefill") or self.pool.healthy("decode")
        costs = [ep.load.wait_s() + prompt_tokens / r for ep in eps if (r := ep.load.rate())]
        return min(costs, default=0.0)

    def _check_response_ids(self, body: dict[str, Any], owner: str) -> None:
        """A Responses request may continue only its own key's responses, and may not take a known response's
        id as its own (vLLM makes a body's ``request_id`` the new response's id)."""
        prev = body.get("previous_response_id")
        if isinstance(prev, str) and self.stored.owned_by_another(prev, owner):
            raise NotFound(f"Response with id '{prev}' not found.", param="previous_response_id")
        rid = body.get("request_id")
        if isinstance(rid, str) and self.stored.known(rid):
            raise BadRequest("'request_id' names a stored response; leave it out or choose a new one",
                             param="request_id")

    async def stored_response(self, method: str, response_id: str, suffix: str, request_id: str,
                              owner: str = "") -> tuple[int, bytes, str] | None:
        """``GET /v1/responses/{id}`` or ``POST /v1/responses/{id}/cancel`` on the decode engine that keeps
        the response; ``None`` when no healthy engine is known to (the caller answers 404)."""
        ep = self.stored.where(response_id, self._answering(), owner)
        if ep is None:
            return None
        s = await self.session()
        try:
            async with s.request(method, f"{ep.url}/v1/responses/{quote(response_id, safe='')}{suffix}",
                                 headers={"X-Request-Id": request_id, **ep.auth()},
                                 timeout=aiohttp.ClientTimeout(total=self.cfg.decode_timeout_s)) as r:
                return r.status, await r.read(), r.headers.get("Content-Type", "application/json")
        except asyncio.TimeoutError as e:
            raise UpstreamTimeout(f"decode engine did not answer within {self.cfg.decode_timeout_s:g}s") from e
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamError(f"decode engine at {ep.url} failed: {e}") from e

    async def forward(self, path: str, body: dict[str, Any], request_id: str) -> tuple[int, bytes, str]:
        """A request one engine answers whole (tokenize, detokenize, embeddings, score): no handoff, so a
        prefill engine when there is one (they hold no streams), else a decode engine."""
        role: Role = "prefill" if self.pool.has("prefill") else "decode"
        ep = self.pool.pick(role)
        try:
            return await self._post_json(ep, path, body, request_id, self.cfg.prefill_timeout_s)
        except UpstreamError:
            self.pool.mark_failed(ep)
            raise

    async def _post_json(
        self, ep: Endpoint, route: Route | str, body: dict[str, Any], request_id: str, timeout_s: float
    ) -> tuple[int, bytes, str]:
        """POST ``body`` to ``ep`` at a route's path (or a path given as such); status, body, content type."""
        path = PATHS[route] if route in PATHS else route  # type: ignore[index]
        s = await self.session()
        ep.inflight += 1
        try:
            for attempt in (1, 2):
                try:
                    async with s.post(
                        ep.url + path,
                        data=json.dumps(body),
                        headers={"Content-Type": "application/json", "X-Request-Id": request_id, **ep.auth()},
                        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.cfg.connect_timeout_s),
                    ) as r:
                        raw = await r.read()
                        return r.status, raw, r.headers.get("Content-Type", "application/json")
                except (aiohttp.ClientError, OSError) as e:
                    if attempt == 1 and stale_connection(e):
                        log.info("request %s: %s engine %s closed a kept-alive connection as it was reused (%s); "
                                 "sending again on a new one", request_id, ep.role, ep.url, e)
                        continue
                    raise
            raise AssertionError("unreachable")
        except asyncio.TimeoutError as e:
            raise UpstreamTimeout(f"{ep.role} engine did not answer within {timeout_s:g}s") from e
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamError(f"{ep.role} engine at {ep.url} failed: {e}") from e
        finally:
            ep.inflight -= 1

    async def _decode(self, route: Route, body: dict[str, Any], request_id: str, *, stream: bool,
                      first: Endpoint | None, key: RoutingKey, flight: Flight, local: bool) -> UpstreamReply:
        """The decode leg on ``first``, then on other replicas while nothing has reached the client.
        ``local``: this engine computes the prompt too (its queue holds the prompt until the first token)."""
        tried: set[str] = set()
        last: RequestError | None = None
        ep = first if first is not None and first.healthy else None
        while True:
            if ep is None:
                try:
                    ep = self.pool.pick("decode", exclude=tried, key=key)
                except NoEngineAvailable:
                    if last is not None:
                        raise last from None
                    raise
            tried.add(ep.url)
            if local:
                flight.queue_prompt(ep)
            flight.start_stream(ep)
            try:
                if stream:
                    reply = await self._decode_stream(ep, route, body, request_id)
                    reply.endpoint = ep
                    return reply
                status, raw, ctype = await self._post_json(ep, route, body, request_id, self.cfg.decode_timeout_s)
            except (UpstreamError, UpstreamTimeout) as e:
                # Nothing reached the client yet: another decode replica may take it.
                self.pool.mark_failed(ep)
                last = e
                ep = None
                continue
            return UpstreamReply(status=status, body=raw, content_type=ctype, endpoint=ep)

    async def _decode_stream(
        self, ep: Endpoint, route: Route, body: dict[str, Any], request_id: str
    ) -> UpstreamReply:
        s = await self.session()
        timeout = self.cfg.decode_timeout_s
        ep.inflight += 1
        try:
            for attempt in (1, 2):
                try:
                    resp = await s.post(
                        ep.url + PATHS[route],
                        data=json.dumps(body),
                        headers={"Content-Type": "application/json", "X-Request-Id": request_id, **ep.auth()},
                        timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=self.cfg.connect_timeout_s),
                    )
                    break
                except (aiohttp.ClientError, OSError) as e:
                    if attempt == 1 and stale_connection(e):
                        log.info("request %s: decode engine %s closed a kept-alive connection as it was reused "
                                 "(%s); sending again on a new one", request_id, ep.url, e)
                        continue
                    raise
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
            except asyncio.TimeoutError:
                # The stream outlived decode_timeout_s: it ends here, in-band (it is not moved elsewhere).
                log.warning("request %s: decode stream on %s passed %gs", request_id, ep.url, timeout)
                yield _error_event(f"decode engine did not finish within {timeout:g}s", 504)
            except (aiohttp.ClientError, OSError) as e:
                # The engine failed mid-stream: it is marked failed (its health probe brings it back), and the
                # stream goes on elsewhere when it can (router/migrate.py), else ends with an error event.
                log.warning("request %s: decode stream on %s broke after %.1fs: %s", request_id, ep.url,
                            time.monotonic() - started, e)
                self.pool.mark_failed(ep)
                raise migrate.StreamBroke(f"decode engine failed mid-stream: {e}") from e
            finally:
                if resp.content.at_eof():
                    resp.release()
                else:
                    # The client left (or the stream broke): closing the connection makes the decode
                    # engine abort the request and free its blocks.
                    resp.close()
                ep.inflight -= 1

        return UpstreamReply(status=200, stream=relay(), content_type="text/event-stream")


def _error_event(message: str, code: int) -> bytes:
    """An OpenAI error as a stream's last event, then ``[DONE]``: the headers are out, the failure goes in-band."""
    err = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return f"data: {json.dumps(err)}\n\n".encode() + b"data: [DONE]\n\n"


async def _in_band(stream: AsyncIterator[bytes], request_id: str) -> AsyncIterator[bytes]:
    """``stream``, with a failure that was not moved elsewhere told to the client as the last event."""
    try:
        async for chunk in stream:
            yield chunk
    except migrate.StreamBroke as e:
        log.warning("request %s: stream ended with an error: %s", request_id, e)
        yield _error_event(str(e), 502)


def stale_connection(e: BaseException) -> bool:
    """Whether ``e`` is an engine closing a pooled keep-alive connection just as the router reused it: the
    write fails or the connection ends before any answer. Nothing was processed, so the same engine may
    get the request again on a new connection. A refused connection is not this: the engine is down."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return False
    return isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))


def _usage(raw: bytes | None) -> dict[str, int]:
    """The ``usage`` object of a non-streamed answer (empty when there is none), in OpenAI's names (the
    Responses and Messages APIs say ``input_tokens`` / ``output_tokens``)."""
    try:
        usage = json.loads(raw or b"{}").get("usage") or {}
        out = {k: int(v) for k, v in usage.items() if isinstance(v, (int, float))}
    except (ValueError, AttributeError, TypeError):
        return {}
    for theirs, ours in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
        if theirs in out:
            out.setdefault(ours, out[theirs])
    return out


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _no_resume(route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
    """A stream's continuation when streams do not move (``router.migrate_streams: false``)."""
    raise NoEngineAvailable("streams do not move to other engines (router.migrate_streams is false)")


async def _first_byte_at(stream: AsyncIterator[bytes], at: list[float]) -> AsyncIterator[bytes]:
    """``stream`` unchanged; the time its first chunk arrived is appended to ``at``."""
    async for chunk in stream:
        if not at:
            at.append(time.perf_counter())
        yield chunk
