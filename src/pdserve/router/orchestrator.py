"""The P/D flow: one client request through admission, the prefill leg, the KV handoff and the decode leg.

:meth:`Orchestrator.handle` runs these stages, each a method of its own:

1. **admit** (:meth:`~pdserve.router.gate.Gate.admit`): the tenant's limits and priority hold
   (router/tenants.py), the request's checks against what the engines accept (router/validate.py), which
   yield the typed :class:`~pdserve.router.request.Request` every later stage decides on, the router's
   in-flight caps, and admission by work (router/admission.py), which picks the prefill and decode engines,
   or decode alone.
2. **prefill leg** (:meth:`~pdserve.router.legs.Legs.prefill`): the prompt on a prefill engine, asked for its
   KV transfer params (and its first token, for the early first token); other replicas on failure, else
   decode alone (``router.prefill_fallback``); a leg reading decode's kept blocks that stalls, again without
   the read.
3. **decode leg** (:meth:`~pdserve.router.legs.Legs.decode`): the request with those params on the decode
   engine, which pulls the blocks over NIXL; other replicas while nothing has reached the client.
4. **the client's stream** (:meth:`~Orchestrator._client_stream`): the decode engine's bytes, wrapped, from
   the innermost out:

   a. ``EngineClient.stream``'s relay: the engine's bytes as they arrive;
   b. ``StoredResponses.sniff`` (Responses): notes the stored answer's id and engine;
   c. ``migrate.resilient`` (movable streams): when the engine fails, the stream goes on elsewhere. It reads
      the engine's own events (token ids), so it comes first;
   d. ``sse.in_band``: a failure that was not moved becomes the stream's last event. Outside (c), so it
      catches what (c) gives up on;
   e. ``LeaseGuard.guarded`` (P/D, slow handoff): decode's first chunk waits until the KV lease is known to
      have held, else the whole stream is replaced by a recompute. Outside (c) and (d): a replacement
      replaces all of them;
   f. ``early.splice`` (early first token): the prefill's first token goes out first, then decode's stream
      less that token. Outside (e), so the client's first byte never waits for the lease check;
   g. :meth:`~Orchestrator._timed`: TTFT, time per token and the phases, as the client reads them; it
      releases the request's claims when the stream ends. Outermost, so it times what the client gets.

Engines are reached through :class:`~pdserve.router.engine_client.EngineClient`, measured when new by
:class:`~pdserve.router.calibration.Calibrator`; a moved stream starts through :class:`~pdserve.router.moves.Moves`;
each stage is a span of the request's trace (router/tracing.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.config.schema import RouterConfig
from pdserve.config.tenants import DEFAULT_TENANT
from pdserve.config.tracing import TracingConfig
from pdserve.errors import UpstreamError
from pdserve.router import admission, early, handback, handoff, migrate, sse, validate
from pdserve.router.calibration import Calibrator
from pdserve.router.effect import PdEffect
from pdserve.router.endpoint import Endpoint, Role
from pdserve.router.engine_client import BIG_ANSWER_BYTES, EngineClient, UpstreamReply, usage
from pdserve.router.flight import Flight
from pdserve.router.gate import Gate
from pdserve.router.lease import Lease, LeaseGuard
from pdserve.router.legs import Legs, span
from pdserve.router.metrics import RouterMetrics
from pdserve.router.moves import Moves
from pdserve.router.pool import EnginePool
from pdserve.router.prompt_length import PromptLength
from pdserve.router.request import Request, Route
from pdserve.router.routing import RoutingKey
from pdserve.router.stored import StoredResponses
from pdserve.router.tracing import Tracing

log = logging.getLogger(__name__)

__all__ = ["Lease", "Orchestrator", "UpstreamReply"]

#: A non-streamed P/D answer's decode leg includes the handoff (the KV pull and decode's first step, over a
#: second for a 1,500-token prompt on a slow CPU host), which its tokens alone cannot be told apart from: its
#: time per token teaches decode's speed only when at least this many tokens spread the handoff out. (Two
#: tokens each made decode's TPOT 1.28 s on such a host, and admission's ``max_tpot_s`` then refused
#: every request.)
WHOLE_ANSWER_TPOT_MIN_TOKENS = 16


class Orchestrator:
    def __init__(self, pool: EnginePool, cfg: RouterConfig, metrics: RouterMetrics | None = None,
                 lengths: PromptLength | None = None, lease_check_after_s: float | None = None,
                 *, lease_s: float | None = None, model_id: str | None = None,
                 on_calibrated: Callable[[Endpoint, float], None] | None = None,
                 limits: validate.EngineLimits | None = None, chat_parsers: bool = False,
                 tracing: TracingConfig | None = None, engine_checks: bool = False,
                 handback_ttl_s: float | None = None) -> None:
        self.pool = pool
        # The engines run a reasoning or tool-call parser: chat content may be withheld (router/early.py).
        self.chat_parsers = chat_parsers
        pool.configure(cfg.plugins)  # the routing plugins' settings (router.plugins)
        self.model_id = model_id
        self.metrics = metrics or RouterMetrics()
        self.client = EngineClient(cfg, on_broken=pool.mark_failed)
        # Which decode engine keeps each stored Responses answer (router/stored.py).
        self.stored = StoredResponses(fetch=lambda ep, rid: self.client.stored(ep, "GET", rid, "", "pdserve-locate"))
        # engine_checks: vLLM's models check each body on an engine (router/validate.py); off, only the
        # router's own rules do (unit tests of the flow, over engines that are not there).
        self.gate = Gate(pool, cfg, self.metrics, lengths or PromptLength(), limits, self.stored, lease_s,
                         self.client if engine_checks else None)
        self.calibrator = Calibrator(self.client, cfg, model_id, on_calibrated, limits.max_model_len if limits else None)
        self.leases = LeaseGuard(self.client, self.metrics, lease_check_after_s, cfg.connect_timeout_s)
        self.stats: dict[str, int] = {"pd": 0, "local": 0, "prefill_fallback": 0, "no_kv_params": 0}
        self.effect = PdEffect()
        self.tracing = Tracing(tracing)  # one trace per request (router/tracing.py); off by default
        self.moves = Moves(self.client, pool, self.metrics)  # where a broken or redone stream goes on
        # nixl.bidirectional: decode engines keep finished requests' blocks for the next turn's prefill
        # (router/handback.py); handback_ttl_s is how long.
        self.handbacks = handback.Handbacks(handback_ttl_s) if handback_ttl_s else None
        self.gate.handbacks = self.handbacks
        # The prefill and decode legs, each with its retries (router/legs.py).
        self.legs = Legs(pool, self.client, cfg, self.metrics, self.stats, self.gate.refused, self.handbacks)
        self.cfg = cfg

    @property
    def cfg(self) -> RouterConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: RouterConfig) -> None:
        """A new router config reaches every part that reads it."""
        self._cfg = self.client.cfg = self.calibrator.cfg = self.gate.cfg = self.legs.cfg = cfg

    @property
    def lease_check_after_s(self) -> float | None:
        return self.leases.check_after_s

    @lease_check_after_s.setter
    def lease_check_after_s(self, v: float | None) -> None:
        self.leases.check_after_s = v

    @property
    def closing(self) -> bool:
        """Set when the router shuts down: new requests get a 503, not a new connection pool."""
        return self.client.closing

    @closing.setter
    def closing(self, v: bool) -> None:
        self.client.closing = v

    async def session(self) -> Any:
        """The pooled connection to the engines (also used to scrape their metrics)."""
        return await self.client.session()

    async def close(self) -> None:
        await self.client.close()
        self.tracing.close()

    async def check(self, ep: Endpoint) -> bool:
        """Health probe; a healthy engine whose speed is not known yet is also calibrated."""
        return await self.calibrator.check(ep)

    async def current_engines(self) -> None:
        """The engine list no older than two refreshes (an idle router reads it seldom: router/pool.py); a
        stopping replica keeps serving for that long after it leaves the list (engine/drain.py)."""
        await self.pool.current(2 * self.cfg.engine_refresh_s)

    # -- the flow -------------------------------------------------------------------------------

    async def handle(self, route: Route, body: dict[str, Any], request_id: str,
                     session: str | None = None, owner: str = "", tenant: str = DEFAULT_TENANT,
                     trace_from: dict[str, str] | None = None) -> UpstreamReply:
        """Admit and run one request. A streamed reply carries its :class:`Flight`: whoever sends the
        stream releases it when the response ends (the stream's own end releases it too). ``trace_from``:
        the client's W3C trace headers, when it sent any."""
        t0 = time.perf_counter()
        trace = self.tracing.request(route, request_id, trace_from)
        try:
            with trace.span("admission"):
                await self.current_engines()
                req, adm, flight, decode_key = await self.gate.admit(route, body, session, owner, tenant)
        except BaseException as e:
            trace.finish(getattr(e, "status_code", None), f"{type(e).__name__}: {e}")
            raise
        flight.trace = trace
        try:
            reply = await self._legs(req, request_id, adm, flight, t0, decode_key, owner)
        except BaseException as e:
            flight.release()
            trace.finish(getattr(e, "status_code", None), f"{type(e).__name__}: {e}")
            raise
        if reply.stream is None:
            flight.release()
            trace.finish(reply.status)
        else:
            reply.flight = flight
        return reply

    # -- stages 2 and 3: the legs -----------------------------------------------------------------

    async def _legs(self, req: Request, request_id: str, adm: admission.Admitted, flight: Flight, t0: float,
                    key: RoutingKey, owner: str = "") -> UpstreamReply:
        """The prefill leg (when admitted to one), then the decode leg; a stream leaves wrapped for the client.
        Decisions read ``req``; the engines get its body, reshaped per leg."""
        m = self.metrics
        route = req.route
        kv: dict[str, Any] | None = None
        lease: Lease | None = None
        reason = adm.reason
        first: early.FirstToken | None = None
        if adm.prefill is not None:
            # (when it is due on decode matters only to by load's placement)
            flight.bound_for(adm.decode, adm.prefill if self.cfg.disaggregate_by_load else None)
            at_once = self.cfg.early_first_token and early.eligible(req, chat_parsers=self.chat_parsers)
            if at_once:
                req = early.seeded(req)
            # The first token's and the prompt's ids let the stream go on from that token (router/early.py).
            pbody = {**req.body, "return_token_ids": True} if at_once else req.body
            flight.trace.begin("prefill")
            kept = await self.legs.kept(req, flight, owner, request_id, adm.prefill)
            kv, lease, answer = await self.legs.prefill(route, pbody, request_id, adm.prefill, flight, kept)
            flight.trace.end("prefill")
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
        decided = "pd" if kv is not None else "local"
        self.stats[decided] += 1
        m.decisions.labels(decided, reason).inc()
        self.effect.record(decided, reason)
        m.pd_share.set(self.effect.share() or 0.0)
        stream = req.stream
        # A stream that may move to another engine if its decode engine fails: its engine returns token ids.
        movable = self.cfg.migrate_streams and migrate.eligible(req, chat_parsers=self.chat_parsers)
        client = req
        body = migrate.tracked(req).body if movable else req.body
        dbody = handoff.decode_body(body, kv) if kv is not None else body
        if (kv is None and self.handbacks is not None and adm.decode.role == "decode"
                and self.handbacks.notable(req, flight.prompt_ids)):
            # The prompt computed on decode: its blocks too are kept for the next turn (any params make a
            # decode engine with bidirectional_kv_xfer keep them; these ask for no pull).
            dbody = handoff.decode_body(body, {"do_remote_prefill": False})
        t_dec = time.perf_counter()
        local = kv is None

        async def recompute() -> UpstreamReply:
            # The pulled blocks may belong to another request by now: decode computes the prompt itself.
            log.warning("request %s: KV lease on %s not held through the handoff; recomputing the prompt",
                        request_id, lease.ep.url if lease else "?")
            m.decisions.labels("local", "kv_lease_lost").inc()
            self.effect.record("local", "kv_lease_lost")
            again = await self.legs.decode(route, body, request_id, stream=stream, first=adm.decode, key=key,
                                           flight=flight, local=True)
            if again.stream is not None:
                # As the stream it replaces reached the client: the ids its engine was asked for taken off
                # again, movable, failures in-band.
                if movable and again.endpoint is not None:
                    again.stream = self._resilient(client, again.stream, again.endpoint, request_id, flight)
                again.stream = sse.in_band(again.stream, request_id)
            return again

        # A stream's first byte from decode ends the KV handoff (or the prompt computed on decode) and starts
        # its decode span (_decoding); a whole answer's one span covers both.
        flight.trace.begin(span(stream, local))
        reply = await self.legs.decode(route, dbody, request_id, stream=stream, first=adm.decode, key=key,
                                       flight=flight, local=local)
        if route == "responses" and reply.status == 200 and reply.endpoint is not None:
            if reply.stream is None:
                self.stored.from_body(reply.body, reply.endpoint, owner)
            else:
                reply.stream = self.stored.sniff(reply.stream, reply.endpoint, owner)  # (b)
                if self.handbacks is not None:  # (its last event is the whole answer, with decode's KV params)
                    reply.stream = handoff.client_events(reply.stream)
        if reply.stream is None:
            if reply.status == 200 and await self.leases.lost(lease, request_id):
                reply = await recompute()
            if reply.body is not None and len(reply.body) > BIG_ANSWER_BYTES:  # (prompt logprobs: tens of MB)
                reply.body = await asyncio.to_thread(handoff.client_answer, reply.body)
            else:
                reply.body = handoff.client_answer(reply.body)
            self._whole_answer(route, reply, flight, t0, t_dec, local)
            if reply.status == 200 and reply.endpoint is not None and self.handbacks is not None:
                self.handbacks.note_answer(req, reply.body, reply.endpoint, request_id, flight.prompt_ids,
                                           handback.scope(owner, req.body))
            return reply
        reply.stream = self._client_stream(client, reply, request_id, flight, t0, t_dec, lease, first, movable,
                                           local, recompute, owner)
        return reply

    def _whole_answer(self, route: Route, reply: UpstreamReply, flight: Flight, t0: float, t_dec: float,
                      local: bool) -> None:
        """A non-streamed answer's figures (its prompt's speed is not among them: the time is mostly decoding)."""
        m = self.metrics
        now = time.perf_counter()
        m.phase.labels("decode").observe(now - t_dec)
        m.e2e.labels(route).observe(now - t0)
        got = usage(reply.body) if reply.status == 200 else {}
        # A stream's first token marks its prompt's end; a non-streamed local answer only leaves the queue here.
        flight.end_prompt(None)
        n_out = got.get("completion_tokens", 0)
        if n_out > 1:
            m.tpot.labels(route).observe((now - t0) / n_out)
        teaches = n_out >= WHOLE_ANSWER_TPOT_MIN_TOKENS and not local
        flight.end_stream((now - t_dec) / n_out if teaches else None)

    # -- stage 4: the client's stream ---------------------------------------------------------------

    def _client_stream(self, req: Request, reply: UpstreamReply, request_id: str, flight: Flight, t0: float,
                       t_dec: float, lease: Lease | None, first: early.FirstToken | None, movable: bool,
                       local: bool, recompute: Callable[[], Any], owner: str = "") -> AsyncIterator[bytes]:
        """The decode stream wrapped (c) to (g), in the order the module's description gives and explains.
        ``req``: the client's request (as the client's stream must look); ``owner``: its tenant's key."""
        assert reply.stream is not None
        route = req.route
        m = self.metrics
        stream = reply.stream
        tape = migrate.Tape(req) if movable and reply.endpoint is not None else None
        if tape is not None and reply.endpoint is not None:
            stream = self._resilient(req, stream, reply.endpoint, request_id, flight, tape)  # (c)
        if reply.endpoint is not None and self.handbacks is not None:
            stream = self.handbacks.noted(stream, req, tape, reply.endpoint, request_id, flight.prompt_ids,
                                          handback.scope(owner, req.body))
        stream = sse.in_band(stream, request_id)  # (d)
        if lease is not None:
            stream = self.leases.guarded(stream, lease, request_id, recompute)  # (e)
        decode_first: list[float] = []
        if first is not None:
            # The client's first token is the prefill leg's; the handoff and decode's pace are timed on
            # decode's own first byte.
            redo = None
            if (first.token_id is not None and first.prompt_ids and reply.endpoint is not None
                    and migrate.eligible(req, chat_parsers=self.chat_parsers)):
                redo = self.moves.from_first(req, first, reply.endpoint, request_id, flight, movable)
            stream = early.splice(route, first,  # (f)
                                  sse.first_byte_at(stream, decode_first, lambda: _decoding(flight, local)),
                                  lambda outcome: m.early_token.labels(outcome).inc(), redo)
        return self._timed(route, stream, t0, t_dec, not local, flight,  # (g)
                           decode_first if first is not None else None)

    def _resilient(self, req: Request, stream: AsyncIterator[bytes], ep: Endpoint, request_id: str, flight: Flight,
                   tape: migrate.Tape | None = None) -> AsyncIterator[bytes]:
        """A movable stream from ``ep`` as its client reads it: taped, going on elsewhere if ``ep`` fails."""
        return migrate.resilient(req, stream, self.moves.resumer(request_id, {ep.url}, flight),
                                 lambda outcome: self.metrics.migrations.labels(outcome).inc(),
                                 tape or migrate.Tape(req))

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
                    if decode_first is None:  # (else the first token is the prefill's: decode's comes later)
                        m.phase.labels("kv_handoff" if pd else "local_prefill").observe(first - t_dec)
                        _decoding(flight, not pd)
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
            flight.trace.finish(200)

    async def stored_response(self, method: str, response_id: str, suffix: str, request_id: str,
                              owner: str = "") -> tuple[int, bytes, str] | None:
        """``GET /v1/responses/{id}`` or ``POST /v1/responses/{id}/cancel`` on the decode engine that keeps
        the response; ``None`` when no healthy engine is known to (the caller answers 404)."""
        await self.current_engines()
        ep = await self.stored.locate(response_id, self.gate.answering(), owner)
        if ep is None:
            return None
        status, raw, ctype = await self.client.stored(ep, method, response_id, suffix, request_id)
        return status, handoff.client_answer(raw) or raw, ctype

    async def forward(self, path: str, body: dict[str, Any], request_id: str) -> tuple[int, bytes, str]:
        """A request one engine answers whole (tokenize, detokenize, embeddings, score): no handoff, so a
        prefill engine when there is one (they hold no streams), else a decode engine."""
        await self.current_engines()
        role: Role = "prefill" if self.pool.has("prefill") else "decode"
        ep = self.pool.pick(role)
        try:
            return await self.client.post(ep, path, body, request_id, self.cfg.prefill_timeout_s)
        except UpstreamError:
            self.pool.mark_failed(ep)
            raise


def _decoding(flight: Flight, local: bool) -> None:
    """Decode's first byte: the handoff's span ends, the decode span starts."""
    flight.trace.end(span(True, local))
    flight.trace.begin("decode")
