"""A request's two legs on the engines, each with what happens when an engine fails under it.

* **The prefill leg** (:meth:`Legs.prefill`): the prompt on a prefill engine, asked for its KV transfer
  params; on a failure or a 5xx, the next prefill replica; when none is left, decode computes the prompt
  itself if it has room (``router.prefill_fallback``). With ``nixl.bidirectional`` the first try may read a
  decode engine's kept blocks of the conversation's last turn (:meth:`Legs.kept`, router/handback.py); a try
  that reads them and stalls is sent again to the same engine without the read (``read_guard_s``).
* **The decode leg** (:meth:`Legs.decode`): the request, with prefill's params when there are any, on the
  decode engine admission chose; while nothing has reached the client, the next decode replica when it
  fails.

:class:`~pdserve.router.orchestrator.Orchestrator` runs them in order and wraps the decode leg's stream for
the client.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.config.schema import RouterConfig
from pdserve.errors import EngineAnswer, NoEngineAvailable, RequestError, UpstreamError, UpstreamTimeout
from pdserve.router import handback, handoff
from pdserve.router.endpoint import Endpoint
from pdserve.router.engine_client import EngineClient, UpstreamReply, usage
from pdserve.router.flight import Flight
from pdserve.router.lease import Lease
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import EnginePool
from pdserve.router.request import Request, Route, lora_adapter
from pdserve.router.routing import RoutingKey

log = logging.getLogger(__name__)

#: What the prefill leg gives back: prefill's KV params (None: decode computes the prompt), the lease on
#: the blocks they name, and prefill's answer (it holds the first token).
PrefillResult = tuple[dict[str, Any] | None, Lease | None, dict[str, Any] | None]


@dataclass(eq=False)
class Legs:
    """The legs of every request of one router. ``stats`` counts the orchestrator's decisions (shared);
    ``refused`` records a refusal in the gate's metrics; ``cfg`` follows the router's config."""

    pool: EnginePool
    client: EngineClient
    cfg: RouterConfig
    metrics: RouterMetrics
    stats: dict[str, int]
    refused: Callable[[str], None]
    handbacks: handback.Handbacks | None

    async def kept(self, req: Request, flight: Flight, owner: str, request_id: str,
                   prefill: Endpoint) -> dict[str, Any] | None:
        """The params of blocks a decode engine kept of this conversation's last turn, for the prefill leg on
        ``prefill`` to read once its queue drains (router/handback.py); ``None`` when none apply."""
        if self.handbacks is None or not flight.prompt_ids:
            return None
        outcome, params = await self.handbacks.read_for(self.client, flight.prompt_ids, handback.scope(owner, req.body),
                                                        lora_adapter(req.body), request_id, self.cfg.connect_timeout_s,
                                                        prefill.load.wait_s())
        self.metrics.handback.labels(outcome).inc()
        return params

    async def prefill(self, route: Route, body: dict[str, Any], request_id: str, first: Endpoint,
                      flight: Flight, kept: dict[str, Any] | None = None) -> PrefillResult:
        """The prefill leg on ``first``, then on other replicas if it fails. ``(None, None, …)`` when decode
        is to compute the prompt itself: prefill answered without usable KV params, or every prefill
        replica failed and decode has room for the prompt (else the request fails: no cascade). ``kept``:
        blocks a decode engine kept of the conversation's last turn, for the first try to read."""
        pbody = handoff.prefill_body(route, body, kept)
        tried: set[str] = set()
        ep: Endpoint | None = first
        while True:
            if ep is None:
                try:
                    ep = self.pool.pick("prefill", exclude=tried)
                except NoEngineAvailable:
                    flight.end_prompt(None)
                    return self._fallback(request_id)
            tried.add(ep.url)
            reading = kept is not None
            # The guard counts the queue ahead of this leg: taken before its own prompt is queued.
            timeout = (handback.read_guard_s(ep, flight.prompt_tokens, self.cfg.prefill_timeout_s) if reading
                       else self.cfg.prefill_timeout_s)
            flight.queue_prompt(ep)
            try:
                status, raw, _ = await self.client.post(ep, route, pbody, request_id, timeout,
                                                        flight.trace.headers("prefill"))
            except (UpstreamError, UpstreamTimeout) as e:
                kept, pbody = None, handoff.prefill_body(route, body)  # decode's kept blocks are read once at most
                if reading and isinstance(e, UpstreamTimeout):
                    log.warning("request %s: prefill on %s reading decode's kept blocks gave no answer in %.0fs; "
                                "sent again without the read", request_id, ep.url, timeout)
                    self.metrics.handback.labels("stalled").inc()
                    continue  # the same engine (router/handback.py, read_guard_s)
                log.warning("request %s: prefill on %s failed (%s); trying another", request_id, ep.url, e)
                self.pool.mark_failed(ep)
                ep = None
                continue
            if status >= 500:
                log.warning("request %s: prefill on %s answered %d; trying another", request_id, ep.url, status)
                ep, kept, pbody = None, None, handoff.prefill_body(route, body)
                continue
            if status != 200:
                flight.end_prompt(None)
                raise EngineAnswer(status, raw, "application/json")
            try:
                answer = json.loads(raw)
            except ValueError as e:
                flight.end_prompt(None)
                raise UpstreamError(f"prefill engine returned invalid JSON: {e}") from e
            flight.end_prompt(usage(raw).get("prompt_tokens") or flight.prompt_tokens)
            kv = handoff.usable_kv_params(answer.get("kv_transfer_params"))
            if kv is None:
                self.stats["no_kv_params"] += 1  # nothing to hand over (e.g. the prompt fit no block): decode computes it
                return None, None, answer
            return kv, Lease(ep, str(kv.get("remote_request_id", "")), time.perf_counter()), answer

    def _fallback(self, request_id: str) -> PrefillResult:
        """Every prefill replica failed this request: decode computes the prompt only if it has room."""
        if self.cfg.prefill_fallback == "error":
            raise NoEngineAvailable("every prefill engine failed this request")
        limit = self.cfg.max_queue_wait_s
        if not any(d.load.wait_s() <= limit for d in self.pool.healthy("decode")):
            self.refused("prefill_failed_decode_busy")
            raise NoEngineAvailable("every prefill engine failed this request and decode has no room for its "
                                    "prompt; retry shortly")
        self.stats["prefill_fallback"] += 1
        log.warning("request %s: every prefill engine failed, prefilling on decode", request_id)
        return None, None, None

    async def decode(self, route: Route, body: dict[str, Any], request_id: str, *, stream: bool,
                     first: Endpoint | None, key: RoutingKey, flight: Flight, local: bool) -> UpstreamReply:
        """The decode leg on ``first``, then on other replicas while nothing has reached the client.
        ``local``: this engine computes the prompt too (its queue holds the prompt until the first token)."""
        tried: set[str] = set()
        last: RequestError | None = None
        ep = first if first is not None and first.healthy else None
        leg = span(stream, local)
        while True:
            if ep is None:
                try:
                    ep = self.pool.pick("decode", exclude=tried, key=key, prefer=flight.lora_fits)
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
                    reply = await self.client.stream(ep, route, body, request_id, flight.trace.headers(leg))
                    reply.endpoint = ep
                    return reply
                status, raw, ctype = await self.client.post(ep, route, body, request_id, self.cfg.decode_timeout_s,
                                                            flight.trace.headers(leg))
            except UpstreamTimeout:
                # The engine is working on it, past decode_timeout_s (a long answer): the request's own time is
                # up (504), not the engine's health (its probes say that), and running it again on every other
                # decode replica would cost each the same (one client's request took them all out of rotation).
                raise
            except UpstreamError as e:
                # Nothing reached the client yet: another decode replica may take it.
                self.pool.mark_failed(ep)
                last = e
                ep = None
                continue
            return UpstreamReply(status=status, body=raw, content_type=ctype, endpoint=ep)


def span(stream: bool, local: bool) -> str:
    """The trace's span of the decode leg until its first byte: the KV handoff, or the prompt computed on
    decode; a whole answer's one span is ``decode``."""
    return ("local_prefill" if local else "kv_handoff") if stream else "decode"
